"""Each prompt root's share of a pool's recent requests (one per pool).

A root is a request's first prefix block: its system prompt or conversation. Whether
copying a root to a pod that has not cached it pays depends on what the root asks of the
pool: a root with more than its holders' share of the traffic outgrows them and has to be
copied, best early; one its holders can carry should stay where it is cached
(`scorers.latency`).

Counts decay exponentially with `horizon_s`, so the share follows the traffic of the
last tens of seconds. Bounded: at most `max_roots` roots (least recently seen dropped
first); O(1) per request.
"""

from __future__ import annotations

import math
from collections import OrderedDict

DEFAULT_HORIZON_S = 20.0
DEFAULT_MAX_ROOTS = 1024


class PrefixDemand:
    """Decayed request counts per root and over the pool."""

    __slots__ = ("_roots", "_total", "_total_at", "horizon_s", "max_roots")

    def __init__(self, horizon_s: float = DEFAULT_HORIZON_S,
                 max_roots: int = DEFAULT_MAX_ROOTS) -> None:
        self.horizon_s = horizon_s
        self.max_roots = max_roots
        self._roots: OrderedDict[int, tuple[float, float]] = OrderedDict()
        self._total = 0.0
        self._total_at = 0.0

    def __len__(self) -> int:
        return len(self._roots)

    def record(self, root: int | None, now: float) -> None:
        """One request of the pool, under `root` (None: no prefix blocks)."""
        self._total = self._decayed(self._total, self._total_at, now) + 1.0
        self._total_at = now
        if root is None:
            return
        count, at = self._roots.pop(root, (0.0, now))
        self._roots[root] = (self._decayed(count, at, now) + 1.0, now)
        if len(self._roots) > self.max_roots:
            self._roots.popitem(last=False)

    def share(self, root: int, now: float) -> float:
        """`root`'s share of the pool's recent requests (0 when unseen)."""
        held = self._roots.get(root)
        total = self._decayed(self._total, self._total_at, now)
        if held is None or total <= 0.0:
            return 0.0
        return min(self._decayed(held[0], held[1], now) / total, 1.0)

    def _decayed(self, count: float, at: float, now: float) -> float:
        return count * math.exp(-max(now - at, 0.0) / self.horizon_s)
