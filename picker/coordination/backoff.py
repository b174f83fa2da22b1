"""Reconnect pacing shared by every Redis link (coordination, tenant limits, sessions).

Capped exponential delays with jitter: the replicas that lost Redis at one moment
must not all come back at the same instant, and a long outage costs at most one try
every `max_s`.
"""

from __future__ import annotations

import asyncio
import random

FIRST_S = 0.05
MAX_S = 2.0


class Backoff:
    """Delays of `first_s` doubling up to `max_s`, each drawn from [½, 1] of its value."""

    def __init__(self, first_s: float = FIRST_S, max_s: float = MAX_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self._next_s = first_s

    def delay(self) -> float:
        """The next wait; the one after is twice as long, up to `max_s`."""
        wait = self._next_s * random.uniform(0.5, 1.0)
        self._next_s = min(self._next_s * 2, self.max_s)
        return wait

    async def sleep(self) -> None:
        await asyncio.sleep(self.delay())

    def reset(self) -> None:
        """After a success: the next failure waits `first_s` again."""
        self._next_s = self.first_s
