"""The per-pool scheduler: filters → scorers → weighted sum → pick, plus accounting.

One `Scheduler` per pool. `pick` is the request path: O(pods) numpy work and
O(prompt blocks) dict lookups, no per-pod Python loop, no I/O. `on_dispatch`
and `on_complete` keep the gateway's own view of each pod current between
scrapes. `explain` shows the same computation pod by pod for `igw explain`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.config import SchedulerConfig
from picker.datastore import Pool
from picker.scheduling.context import ScoringContext
from picker.scheduling.errors import NoCandidates
from picker.scheduling.plugins import PodFilter
from picker.scheduling.prefix_index import DEFAULT_BLOCKS_PER_POD
from picker.scheduling.profiles import Profile, build_profile, profile_for
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.scorers.latency import PredictedLatency, cached_ttft
from picker.scheduling.state import PoolState

__all__ = ["NoCandidates", "Pick", "Scheduler"]

log = logging.getLogger("picker.scheduling")

DEGRADED_PROFILE = "least-request"


@dataclass(frozen=True, slots=True)
class Pick:
    """The chosen pod first, then distinct fallbacks, best first.

    `scores` are the weighted totals (all 0.0 for the unscored baselines and
    when there was a single candidate: nothing needed scoring).
    """

    rows: tuple[int, ...]
    addresses: tuple[str, ...]
    scores: tuple[float, ...]
    # True when every candidate's metrics were stale and the pick used the
    # gateway's own in-flight counts only.
    degraded: bool = False
    # Fraction of the prompt's blocks the chosen pod had (its expected cache hit).
    cached: float = 0.0


class Scheduler:
    """Routes the requests of one pool."""

    def __init__(
        self,
        pool: Pool,
        max_fallbacks: int = 2,
        rng: np.random.Generator | None = None,
        *,
        blocks_per_pod: int = DEFAULT_BLOCKS_PER_POD,
    ) -> None:
        self.pool = pool
        self.max_fallbacks = max_fallbacks
        self.rng = rng if rng is not None else np.random.default_rng()
        self.state = PoolState(pool, blocks_per_pod)
        self.profile: Profile = profile_for(pool.config)
        self._degraded: Profile = build_profile(DEGRADED_PROFILE)
        self._listeners: list[Callable[[], None]] = []

    # -- configuration -------------------------------------------------------------

    def reconfigure(
        self, source: Pool | SchedulerConfig | None = None, max_fallbacks: int | None = None
    ) -> None:
        """Adopt a reloaded config; learned state (prefix index, speeds) is kept.

        `source` is the pool (whose `config` was replaced) or the new config.
        A different Pool object means different rows, so its state restarts.
        """
        if isinstance(source, Pool):
            if source is not self.pool:
                self.pool = source
                self.state = PoolState(source, self.state.prefix.blocks_per_pod)
        elif isinstance(source, SchedulerConfig):
            self.pool.config = source
        if max_fallbacks is not None:
            self.max_fallbacks = max_fallbacks
        self.profile = profile_for(self.pool.config)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called (synchronously, must be cheap) after every dispatch and completion."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    # -- request path ----------------------------------------------------------------

    def pick(self, req: SchedulingRequest, now: float) -> Pick:
        """Best pod for `req` and up to `max_fallbacks` next-best; raises NoCandidates."""
        ctx, degraded = self._filter(req, now)
        n = len(ctx.rows)
        if n == 0:
            raise NoCandidates(self.pool.name, self._drop_reasons(req, now))
        profile = self._degraded if degraded else self.profile
        if n == 1:
            positions = np.zeros(1, dtype=np.intp)
            totals = np.zeros(1)
        else:
            totals = self._totals(ctx, profile) if profile.picker.uses_scores else np.zeros(n)
            positions = profile.picker.choose(totals, 1 + self.max_fallbacks, self.rng)
        cached = 0.0
        if len(req.prefix_hashes):
            hit = ctx.matched_blocks_at(int(positions[0]))
            self.state.prefix_query_blocks += len(req.prefix_hashes)
            self.state.prefix_hit_blocks += int(hit)
            cached = hit / len(req.prefix_hashes)
        rows = tuple(ctx.rows[positions].tolist())
        addresses = tuple(self.pool.row_address[r] or "" for r in rows)
        scores = tuple(totals[positions].tolist())
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decision pool=%s profile=%s candidates=%d pods=%s scores=%s degraded=%s "
                "adapter=%s prompt_tokens=%d blocks=%d",
                self.pool.name, profile.name, n, ",".join(addresses),
                ",".join(f"{s:.3f}" for s in scores), degraded, req.adapter,
                req.prompt_tokens, len(req.prefix_hashes),
            )
        return Pick(rows, addresses, scores, degraded, cached)

    def on_dispatch(
        self, row: int, req: SchedulingRequest, now: float, cached: float = 0.0
    ) -> None:
        """`req` was sent to `row` (expecting the `cached` fraction of its prompt to hit
        the pod's cache): count its work there now (closes the scrape gap)."""
        self.state.on_dispatch(row, req, now, cached)
        self._notify()

    def on_complete(
        self,
        row: int,
        req: SchedulingRequest,
        now: float,
        duration_s: float,
        ok: bool,
        *,
        output_tokens: int | None = None,
        address: str | None = None,
    ) -> None:
        """`req` ended on `row`: release its work; learn the pod's speed if it succeeded.

        `address` (optional) guards against a row reused by another pod while
        the request ran; `output_tokens`, when known, refines the speed sample.
        """
        if address is not None and self.pool.row_address[row] != address:
            return
        self.state.on_complete(row, req, duration_s, ok, output_tokens, now)
        self._notify()

    def on_remote_dispatch(
        self, row: int, req: SchedulingRequest, now: float, cached: float = 0.0
    ) -> None:
        """Another gateway replica sent `req` to `row` (picker.coordination): count it in
        the same columns as a local dispatch, `picks` aside."""
        self.state.on_dispatch(row, req, now, cached, remote=True)
        self._notify()

    def on_remote_complete(
        self, row: int, req: SchedulingRequest, now: float, duration_s: float, address: str,
        origin_duration_s: float | None = None,
    ) -> None:
        """Another replica's request on `row` ended (or its replica died): release its
        work. `duration_s` is measured from when this replica counted the dispatch;
        `origin_duration_s`, the origin's own measure of a success, teaches the pod's
        speed as a local one does (None: a failure, an aged-out request or an older
        replica, nothing learned)."""
        if self.pool.row_address[row] != address:
            return
        self.state.on_complete(row, req, duration_s, True, now=now, remote=True,
                               origin_duration_s=origin_duration_s)
        self._notify()

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    # -- internals -------------------------------------------------------------------

    def _filter(
        self, req: SchedulingRequest, now: float, dropped: dict[int, str] | None = None
    ) -> tuple[ScoringContext, bool]:
        """Candidates after the profile's filters, and whether routing is degraded.

        Fast path: AND the request-independent masks over the table at once.
        The filter-by-filter walk runs only when reasons are wanted or the
        fast path found nobody (to tell "none ready" from "all stale").
        """
        self.state.sync()
        table = self.pool.table
        filters = self.profile.filters
        if dropped is None:
            mask = table.valid
            for f in filters:
                if isinstance(f, PodFilter):
                    mask = mask & f.mask(self.pool, now)
            if mask.any():
                ctx = ScoringContext(self.pool, self.state, req, np.flatnonzero(mask), now)
                for f in filters:
                    if not isinstance(f, PodFilter):
                        keep = f.keep(ctx)
                        if not keep.all():
                            ctx.narrow(keep)
                return ctx, False
        ctx = ScoringContext(self.pool, self.state, req, np.flatnonzero(table.valid), now)
        degraded = False
        for f in filters:
            if not len(ctx.rows):
                break
            keep = f.keep(ctx)
            if keep.all():
                continue
            if f.degrade_when_empty and not keep.any():
                fallback = f.fallback(ctx)
                if fallback.any():
                    degraded = True
                    if not fallback.all():
                        ctx.narrow(fallback)
                    continue
            if dropped is not None:
                for row in ctx.rows[~keep].tolist():
                    dropped[row] = f.reason
            ctx.narrow(keep)
        return ctx, degraded

    def _drop_reasons(self, req: SchedulingRequest, now: float) -> Counter[str]:
        dropped: dict[int, str] = {}
        self._filter(req, now, dropped)
        return Counter(dropped.values())

    @staticmethod
    def _totals(ctx: ScoringContext, profile: Profile) -> np.ndarray:
        """Weighted sum of the scorers: one row per scorer, one matrix-vector product."""
        if not profile.scorers:
            return np.zeros(len(ctx.rows))
        matrix = np.empty((len(profile.scorers), len(ctx.rows)))
        for i, (scorer, _) in enumerate(profile.scorers):
            matrix[i] = scorer.score(ctx)
        return profile.weight_vector @ matrix

    # -- explain -----------------------------------------------------------------------

    def explain(self, req: SchedulingRequest, now: float) -> dict[str, Any]:
        """What `pick` would do now, pod by pod; changes no state and no counter.

        Keys: pool, model, adapter, profile, weights, degraded, picked (addresses,
        best first, ties in row order), pods: [{address, row, total, scores
        {scorer: raw score in [0,1]}, predicted_ttft_s?, filtered_reason}], and for an
        adapter request adapter_slots (`PoolState.slot_knowledge`).
        """
        dropped: dict[int, str] = {}
        ctx, degraded = self._filter(req, now, dropped)
        profile = self._degraded if degraded else self.profile
        n = len(ctx.rows)
        per_scorer = {
            s.name: np.broadcast_to(s.score(ctx), (n,)) for s, _ in profile.scorers
        } if n else {}
        totals = np.zeros(n)
        for scorer, weight in profile.scorers:
            if n:
                totals += weight * per_scorer[scorer.name]
        ttft = self._explain_ttft(ctx, profile)
        order = np.argsort(-totals, kind="stable")
        pods: list[dict[str, Any]] = []
        for pos in order.tolist():
            row = int(ctx.rows[pos])
            pod: dict[str, Any] = {
                "address": self.pool.row_address[row],
                "row": row,
                "total": float(totals[pos]),
                "scores": {name: float(v[pos]) for name, v in per_scorer.items()},
                "filtered_reason": "",
            }
            if ttft is not None:
                pod["predicted_ttft_s"] = float(ttft[pos])
            pods.append(pod)
        for row, reason in dropped.items():
            pods.append(
                {"address": self.pool.row_address[row], "row": row, "total": 0.0,
                 "scores": {}, "filtered_reason": reason}
            )
        return {
            "pool": self.pool.name,
            "model": req.model,
            "adapter": req.adapter,
            "profile": profile.name,
            "weights": profile.weights,
            "degraded": degraded,
            "picked": self._explain_picked(ctx, order, profile),
            "pods": pods,
            **({"adapter_slots": self.state.slot_knowledge(now)} if req.adapter else {}),
        }

    @staticmethod
    def _explain_ttft(ctx: ScoringContext, profile: Profile) -> np.ndarray | None:
        for scorer, _ in profile.scorers:
            if isinstance(scorer, PredictedLatency) and len(ctx.rows):
                return cached_ttft(ctx, scorer.batch_capacity)
        return None

    def _explain_picked(
        self, ctx: ScoringContext, order: np.ndarray, profile: Profile
    ) -> list[str]:
        count = 1 + self.max_fallbacks
        n = len(ctx.rows)
        if not n:
            return []
        if profile.picker.uses_scores:
            positions = order[:count]
        elif hasattr(profile.picker, "counter"):
            positions = (profile.picker.counter % n + np.arange(min(count, n))) % n
        else:
            return []  # random: no prediction to show
        return [self.pool.row_address[int(r)] or "" for r in ctx.rows[positions]]
