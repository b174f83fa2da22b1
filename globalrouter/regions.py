"""What the global router knows about every region, as arrays over regions.

One row per configured region, in config order. The poller writes what each
region's load summary says (picker.load_summary) and how long the poll took;
`rebuild` turns the latest summaries into one `ModelView` per served model
name (base models and LoRA adapters alike), arrays over the same rows, so a
request's placement is a handful of numpy operations and never walks the
summaries. Everything here runs off the request path except reading, and
`note_placed`: the prompt tokens the router placed on a region since the poll
whose summary it last read, which that summary cannot show yet.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contract.global_config import GlobalRouterConfig, ModelPolicy, region_address

# RTT is the median of the last few polls: one slow poll (a new TLS handshake, a
# scheduling hiccup on a busy machine) should not move a region's place.
RTT_SAMPLES = 5
# A poll outstanding longer than SUSPECT_RTTS times the region's RTT (but at least
# SUSPECT_FLOOR_S, at most the poll timeout) makes the region suspect: placed after every
# region that is not, without waiting for the timeout. The floor keeps the usual hiccups
# of a loaded machine (a poll of a 10 ms region taking 100-200 ms) from moving anything;
# one larger hiccup costs the region its place for one poll, never its freshness.
SUSPECT_RTTS = 4.0
SUSPECT_FLOOR_S = 0.3


@dataclass
class ModelView:
    """One model name across regions: whether each serves it and how well, right now."""

    serves: np.ndarray  # bool: a pool of the region serves the name
    ready: np.ndarray  # bool: and it has at least one ready pod
    ttft_s: np.ndarray  # the summary's predicted TTFT of a typical request (inf: unknown)
    saturation: np.ndarray  # the pool's saturation (0 when unknown)
    saturated: np.ndarray  # bool: the Tier-1 picker says the pool is saturated
    waiting: np.ndarray  # bool: requests wait there (its admission queue or engines)
    cost: np.ndarray  # the region's price for the name (inf: not priced)
    typical_tokens: np.ndarray  # the prompt `ttft_s` is for (0: unknown)
    prefill_tps: np.ndarray  # the prefill speed of the pod `ttft_s` is for (0: unknown)
    ready_pods: np.ndarray  # ready pods of the pool (how placed work spreads)


@dataclass
class RegionStatus:
    """One region's poll history (the poller's, in monotonic seconds)."""

    last_ok: float = -math.inf  # the last summary whose generation moved
    generation: int = -1
    failures: int = 0  # consecutive failed polls
    definite: bool = True  # the last failure was not a timeout
    error: str = ""
    summary: dict[str, Any] | None = None
    rtts: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))


class RegionTable:
    """The regions of one config, their poll state and the per-model views."""

    def __init__(self, config: GlobalRouterConfig) -> None:
        self.config = config
        self.names = tuple(r.name for r in config.regions)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.addresses = tuple(region_address(r) for r in config.regions)
        self.drained = np.array([r.drain for r in config.regions], dtype=bool)
        self.status = [RegionStatus() for _ in config.regions]
        n = len(self.names)
        self.rtt_s = np.zeros(n)
        self.fresh_until = np.full(n, -math.inf)
        # suspicion (see SUSPECT_RTTS): the outstanding poll's start (NaN: none), the bound
        # on its age, and what the last poll said (failed, or answered but too slowly)
        self.poll_started = np.full(n, math.nan)
        self.suspect_after_s = np.full(n, self._suspect_bound(0.0))
        self.doubted = np.zeros(n, dtype=bool)
        self.views: dict[str, ModelView] = {}
        # per model name: prompt tokens placed per region that no summary read so far
        # can show (`pending`), and how many of them the poll in flight will (`_sent`)
        self.pending: dict[str, np.ndarray] = {}
        self._sent: dict[str, np.ndarray] = {}
        self._residency: dict[tuple[str, ...], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.names)

    def reconfigure(self, config: GlobalRouterConfig) -> None:
        """A reloaded config (globalrouter.reload: the same regions, in the same order):
        drains, prices, tags and staleness now come from it."""
        self.config = config
        self.drained = np.array([r.drain for r in config.regions], dtype=bool)
        self._residency = {}
        for row in range(len(self.names)):
            self._refresh_row(row)
        self.rebuild()

    # -- written by the poller ------------------------------------------------------

    def _suspect_bound(self, rtt_s: float) -> float:
        timeout = self.config.polling.timeout_s
        return min(max(SUSPECT_FLOOR_S, SUSPECT_RTTS * rtt_s), timeout)

    def poll_sent(self, row: int, now: float) -> None:
        """A poll of `row` leaves now: from now on its age is watched per request (suspect
        regions); what was placed there so far, its summary will show (or a later one),
        what is placed from now on, it may not."""
        self.poll_started[row] = now
        for name, pending in self.pending.items():
            self._sent[name][row] = pending[row]

    def _absorb(self, row: int) -> None:
        """A summary of `row` arrived: the work placed before its poll left is in it."""
        for name, pending in self.pending.items():
            pending[row] = max(0.0, pending[row] - self._sent[name][row])
            self._sent[name][row] = 0.0

    def record_ok(self, row: int, summary: dict[str, Any], rtt_s: float, now: float) -> None:
        """A summary arrived; it counts as fresh only if its generation moved (a picker
        whose rebuild loop is stuck keeps answering the same document)."""
        status = self.status[row]
        status.failures = 0
        status.error = ""
        # judged against the bound of the RTT known before it: a region that turned slow
        # stays suspect until its slowness is the median, then is placed by its RTT
        slow = rtt_s > self.suspect_after_s[row]
        status.rtts.append(rtt_s)
        self.rtt_s[row] = float(np.median(status.rtts))
        self.suspect_after_s[row] = self._suspect_bound(float(self.rtt_s[row]))
        self.poll_started[row] = math.nan
        self.doubted[row] = slow
        generation = int(summary.get("generation", -1))
        if generation != status.generation and summary.get("serving", False):
            status.last_ok = now
            status.generation = generation
        elif not summary.get("serving", False):
            status.last_ok = -math.inf
        status.summary = summary
        self._absorb(row)
        self._refresh_row(row)
        self.rebuild()

    def record_failure(self, row: int, error: str, definite: bool = True) -> None:
        """The poll failed. `definite` (refused, reset, not a summary): the region is
        unknown until a poll succeeds again. A timeout is not definite on its own (a busy
        machine, one slow answer): the region is unknown from the second in a row."""
        status = self.status[row]
        status.failures += 1
        status.error = error
        status.definite = definite
        self.poll_started[row] = math.nan
        self.doubted[row] = True
        self._refresh_row(row)
        self.rebuild()

    def _refresh_row(self, row: int) -> None:
        status = self.status[row]
        tolerated = status.failures == 0 or (status.failures == 1 and not status.definite)
        ok = tolerated and status.last_ok > -math.inf
        stale = self.config.polling.stale_after_s
        self.fresh_until[row] = status.last_ok + stale if ok else -math.inf

    def rebuild(self) -> None:
        """The per-model views from every region's latest summary (fresh or not: the
        freshness mask is applied per request, so a view never outlives its data)."""
        n = len(self.names)
        views: dict[str, ModelView] = {}
        for row, status in enumerate(self.status):
            pools = (status.summary or {}).get("pools") or []
            for pool in pools:
                for name in (pool.get("model"), *(pool.get("adapters") or ())):
                    if isinstance(name, str) and name:
                        view = views.get(name) or views.setdefault(name, self._empty_view(name, n))
                        _fill(view, row, pool)
        self.views = views

    def _empty_view(self, model: str, n: int) -> ModelView:
        cost = np.full(n, math.inf)
        for row, region in enumerate(self.config.regions):
            price = region.costs.get(model)
            if price is not None:
                cost[row] = price.value
        return ModelView(
            serves=np.zeros(n, dtype=bool),
            ready=np.zeros(n, dtype=bool),
            ttft_s=np.full(n, math.inf),
            saturation=np.zeros(n),
            saturated=np.zeros(n, dtype=bool),
            waiting=np.zeros(n, dtype=bool),
            cost=cost,
            typical_tokens=np.zeros(n),
            prefill_tps=np.zeros(n),
            ready_pods=np.zeros(n),
        )

    # -- per request ----------------------------------------------------------------

    def note_placed(self, model: str, row: int, prompt_tokens: int) -> None:
        """The router placed a request of `prompt_tokens` on `row` (its first choice)."""
        pending = self.pending.get(model)
        if pending is None:
            pending = self.pending[model] = np.zeros(len(self.names))
            self._sent[model] = np.zeros(len(self.names))
        pending[row] += max(prompt_tokens, 0)

    def pending_tokens(self, model: str) -> np.ndarray | None:
        """Prompt tokens placed per region that no summary read so far shows (None: none
        placed yet)."""
        return self.pending.get(model)

    def fresh(self, now: float) -> np.ndarray:
        """Bool per region: its last poll succeeded and its summary is not stale."""
        return self.fresh_until >= now

    def suspect(self, now: float) -> np.ndarray:
        """Bool per region: its last poll failed or was slow, or the poll out now is
        overdue (older than its RTT-derived bound). Placement puts these last; a region
        stays placeable while every region is suspect (the router itself stalled)."""
        # no poll out: NaN, and a comparison with NaN is False (numpy warns on none)
        return self.doubted | (now - self.poll_started > self.suspect_after_s)

    def residency_mask(self, policy: ModelPolicy) -> np.ndarray | None:
        """Bool per region allowed by the policy's residencies (None: no constraint);
        computed once per residency list."""
        if not policy.residency:
            return None
        mask = self._residency.get(policy.residency)
        if mask is None:
            allowed = set(policy.residency)
            mask = np.array([r.residency in allowed for r in self.config.regions], dtype=bool)
            self._residency[policy.residency] = mask
        return mask

    def models(self) -> list[str]:
        return sorted(self.views)

    def describe(self, now: float | None = None) -> list[dict[str, Any]]:
        """Every region's state, for `/regions` and `igw global status`."""
        now = time.monotonic() if now is None else now
        fresh = self.fresh(now)
        suspect = self.suspect(now)
        out = []
        for row, region in enumerate(self.config.regions):
            status = self.status[row]
            age = now - status.last_ok if status.last_ok > -math.inf else None
            out.append({
                "name": region.name,
                "endpoint": region.endpoint,
                "address": self.addresses[row],
                "tags": region.tags,
                "drained": bool(self.drained[row]),
                "fresh": bool(fresh[row]),
                "suspect": bool(suspect[row]),
                "summaryAgeS": round(age, 3) if age is not None else None,
                "rttS": round(float(self.rtt_s[row]), 4),
                "failures": status.failures,
                "error": status.error,
                "generation": status.generation,
                "pools": (status.summary or {}).get("pools", []),
            })
        return out


def _fill(view: ModelView, row: int, pool: dict[str, Any]) -> None:
    """One summary pool entry into its view's row (a name served twice in a region: the
    readier entry wins)."""
    ready = _number(pool.get("readyPods")) > 0
    if view.ready[row] and not ready:
        return
    view.serves[row] = True
    view.ready[row] = ready
    ttft = pool.get("predictedTtftS")
    view.ttft_s[row] = _number(ttft) if ttft is not None and ready else math.inf
    view.saturation[row] = _number(pool.get("saturation"))
    view.saturated[row] = pool.get("saturated") is True
    view.waiting[row] = _number(pool.get("queueLength")) + _number(pool.get("engineWaiting")) > 0
    view.typical_tokens[row] = _number(pool.get("typicalPromptTokens"))
    view.prefill_tps[row] = _number(pool.get("prefillTokensPerS"))
    view.ready_pods[row] = _number(pool.get("readyPods"))


def _number(value: Any) -> float:
    """A summary figure as a float; anything else (a broken or hostile summary) is 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(float(value), 0.0)
