"""Errors the scheduling layer raises.

`NoCandidates` is scheduling's own (the director maps it to bbr's
`NoReadyEndpoint`, 503); overload and queue timeouts are raised directly as
bbr's client-visible `Overloaded` (429) and `QueueTimeout` (503).
"""

from __future__ import annotations

from collections import Counter

from contract.errors import NoReadyEndpoint, Overloaded, QueueTimeout

__all__ = ["NoCandidates", "NoReadyEndpoint", "Overloaded", "QueueTimeout"]


class NoCandidates(Exception):
    """No pod of the pool passed the filters; `reasons` counts why pods were dropped."""

    def __init__(self, pool: str, reasons: Counter[str] | None = None) -> None:
        self.pool = pool
        self.reasons: Counter[str] = reasons or Counter()
        detail = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items())) or "no pods"
        super().__init__(f"pool {pool}: no candidate pod ({detail})")
