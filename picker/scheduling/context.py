"""One request's view of the candidate pods, shared by the filters and scorers.

Columns are gathered for the candidate rows once and cached, and signals
that several scorers use (queue depth with the in-flight correction, prefix
match) are computed once per request. When the candidates are rows 0..n-1
(every pod healthy, the common case) columns are sliced, not gathered: a
view costs nothing. Scorers must treat columns as read-only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from picker.datastore import PodTable, Pool
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.state import PoolState


class ScoringContext:
    """Candidate rows of one pool for one request at time `now`."""

    __slots__ = (
        "_cols", "_hashes", "_matched", "index", "latency", "now", "pool", "req", "rows", "state",
        "table", "ttft",
    )

    def __init__(
        self,
        pool: Pool,
        state: PoolState,
        req: SchedulingRequest,
        rows: np.ndarray,
        now: float,
    ) -> None:
        self.pool = pool
        self.table: PodTable = pool.table
        self.state = state
        self.req = req
        self.rows = rows
        self.index: slice | np.ndarray = _index(rows)
        self.now = now
        self._cols: dict[str, np.ndarray | None] = {}
        self._matched: np.ndarray | None = None
        self._hashes: list[int] | None = None
        # min(ttft) / ttft per candidate once predictedLatency has computed it
        # (scorers gated by it reuse it instead of recomputing the model)
        self.latency: np.ndarray | None = None
        # (batch capacity, predicted TTFT per candidate) once computed: a row's TTFT does
        # not depend on the other candidates, so narrowing keeps it (lora-home computes it
        # before the scorers do)
        self.ttft: tuple[float, np.ndarray] | None = None

    def narrow(self, keep: np.ndarray) -> None:
        """Keep only the candidates where `keep` is true (filters call this)."""
        self.rows = self.rows[keep]
        self.index = _index(self.rows)
        self._cols.clear()
        self._matched = None
        self.latency = None
        if self.ttft is not None:
            self.ttft = (self.ttft[0], self.ttft[1][keep])

    def col(self, name: str) -> np.ndarray:
        """Datastore column `name` for the candidate rows (gathered once, read-only)."""
        values = self._cols.get(name)
        if values is None:
            values = self._cols[name] = getattr(self.table, name)[self.index]
        return values

    def derived(self, key: str, compute: Callable[[ScoringContext], np.ndarray]) -> np.ndarray:
        """`compute(self)` once per candidate set (a filter's narrowing drops it), for a
        value several filters and scorers derive alike from the candidates' rows."""
        values = self._cols.get(key)
        if values is None:
            values = self._cols[key] = compute(self)
        return values

    def queue_depth(self) -> np.ndarray:
        """Scraped waiting plus requests the gateway sent since that scrape."""
        values = self._cols.get("_queue")
        if values is None:
            values = self._cols["_queue"] = self.col("waiting") + self.col("dispatched")
        return values

    def since_scrape_tokens(self) -> np.ndarray | None:
        """Prompt tokens the gateway sent each candidate since its last scrape (None: none)."""
        if "_since_tokens" not in self._cols:
            self._cols["_since_tokens"] = self.state.since_scrape_tokens(  # type: ignore[assignment]
                self.index, self.col("dispatched")
            )
        return self._cols["_since_tokens"]

    def unseen_requests(self) -> np.ndarray | None:
        """`PoolState.unseen_requests` of the candidates, once per candidate set (the
        latency model and the queue tie-break both read it)."""
        if "_unseen" not in self._cols:
            self._cols["_unseen"] = self.state.unseen_requests(self.index)
        return self._cols["_unseen"]

    def speeds(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefill tokens/s, decode step s) per candidate, unknown speeds filled; for a
        request without an adapter an untried idle pod is guessed so it gets tried
        (`PoolState.probe_speeds`). A stale pod is retried at the pool median only where
        `PoolState.may_retry_stale`, else priced by `PoolState.cautious_speeds`."""
        probe = self.req.adapter is None
        if not self.state.may_retry_stale():
            return self.state.cautious_speeds(self.now, self.index, probe)
        if probe:
            return self.state.probe_speeds(self.now, self.index)
        tps, step = self.state.speeds(self.now)
        return tps[self.index], step[self.index]

    @property
    def hashes(self) -> list[int]:
        if self._hashes is None:
            self._hashes = self.req.prefix_hashes.tolist()
        return self._hashes

    def prefix_matched(self) -> np.ndarray | None:
        """Leading prompt blocks last routed to each candidate; None when no candidate has any."""
        if self._matched is None:
            full = self.state.prefix.match(self.hashes, self.table.capacity)
            matched = full[self.index] if full is not None else _NONE
            self._matched = matched if matched.any() else _NONE
        return None if self._matched is _NONE else self._matched

    def matched_blocks_at(self, position: int) -> float:
        """Blocks matched on one candidate if a scorer computed the match, else 0."""
        if self._matched is None or self._matched is _NONE:
            return 0.0
        return float(self._matched[position])

    def prefix_fraction(self) -> np.ndarray | None:
        """Matched / total blocks per candidate, or None when there is no hit at all."""
        matched = self.prefix_matched()
        if matched is None:
            return None
        return matched / len(self.hashes)


_NONE = np.empty(0)


def _index(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when `rows` is 0..n-1 (sorted and unique, as flatnonzero gives), else rows."""
    n = len(rows)
    if n and rows[-1] == n - 1:
        return slice(0, n)
    return rows
