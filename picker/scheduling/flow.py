"""Flow control: how much work a pod may be committed to before the rest waits.

Admission used to judge a pool on what its pods last *reported* (the engine's
waiting count). In a burst that is blind exactly when it matters: the engine
admits hundreds of requests into its running batch before its waiting count
moves, the scrape that would show it lags by an interval, and a flooded event
loop delays that scrape further. Measured: a cold two-pod pool took 1,063 of
1,500 concurrent 800-word requests within one second, on a 0.7 s old scrape,
and served them 35 s later.

So the gateway bounds what it commits itself, from what it knows it sent. A
pod's committed work is the uncached prompt tokens the gateway (and its
replicas, picker.coordination) sent it that the pod had not prefilled at its
last scrape (PoolState's prefill backlog, clocked by the engine's own
prompt-token counter) plus those sent since that scrape. At the pod's learned
prefill speed (a deliberately slow default until one is learned) that is the
time a newly sent request waits before its own prefill starts. A pod has room
for a request while that time, the request included, stays within
`saturation.maxStartDelay`; an idle pod always has room (a prompt larger than
the whole budget must still run somewhere). What has no room waits in the
admission queue and is released as the backlog drains.

The start delay counts prefill work only, not the wait for a batch slot: a pod
of 4 slots and ~0.5 s requests took dozens of short prompts within the bound,
which then waited seconds in the engine's own first-come-first-served queue,
where the gateway's fair queue cannot reorder them. So once every routable
pod's slots are learned (PoolState.slot_limits), the pool also has room only
while the gateway's requests in flight on it are fewer than its slots plus
`slotAllowance` per pod (`slots_room`): the excess waits in the gateway's
queue. That bound is the pool's, not each pod's: which pod a request goes to
stays the scorers' choice (a fast pod with a short engine queue beats an
idle slow one; a per-pod slot filter made the scenario family's TTFT p95
worse, bench/family.py, median x best-ttft 1.13 -> 1.34). Only while tenants
share the slots (picker.scheduling.shares) does the pick prefer a pod with a
slot free (`free_slots`), so that a tenant within its share starts at once.
Unknown slots: only the start-delay bound applies.

Where a pod's engine exports nothing a prefill speed is learned from (no TTFT or
prefill-time histogram, no prompt-token counter: Triton's TensorRT-LLM page,
`prefill_unmeasured`), the start-delay bound is not applied to it. There the speed is
the deliberately slow default (1,000 tokens/s), or the floor its finished requests
prove, which divides by whole durations, decode included, and so is barely higher.
So 2 s held about two median prompts, and a pod sent one request since its last
scrape had no room. On the scenario family that left one pod in the very decisions
of the tail: family-0-6 (two L40S), 87 of 316 decisions, 11 of the 16 behind its
p95.

Such an engine admits what it is sent into its next steps anyway (its load shows
in the step length, `iteration_s`); learned batch slots still bound the pool
(`slots_room`). Without the bound there: TTFT p95 geometric mean 0.996 / 0.992 /
0.997x on the family's seeds 0 / 1 / 2, the worst member unchanged on each
(docs/benchmarks.md, "No start-delay bound where the page measures no prefill").

Everything is a few numpy operations over the pool's rows: no per-pod loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import candidate_pods, saturated_pods
from picker.scheduling.state import PoolState

# Below this many committed tokens a pod counts as idle (rounding of the counters).
IDLE_TOKENS = 1.0


def committed_tokens(state: PoolState, index: slice | np.ndarray) -> np.ndarray:
    """Uncached prompt tokens sent to rows `index` and not prefilled yet, as far as
    the gateway can tell (the backlog at the last scrape, plus sends since)."""
    t = state.pool.table
    work = state.backlog_work(index)
    since = state.since_scrape_tokens(index, t.dispatched[index])
    if since is not None:
        work = work + since * (1.0 - state.cached_share[index])
    return work


def pod_room(
    state: PoolState, req: SchedulingRequest, now: float, index: slice | np.ndarray
) -> np.ndarray:
    """Boolean per row of `index`: sending `req` there keeps the pod's start delay
    within `maxStartDelay` (always true when the bound is off, the pod is idle, or its
    page measures no prefill: see the module docstring)."""
    bound = state.pool.config.saturation.max_start_delay_s
    work = committed_tokens(state, index)
    if bound <= 0:
        return np.ones(len(work), dtype=bool)
    tps = start_speeds(state, now, index)
    cost = max(float(req.prompt_tokens), 1.0) * (1.0 - state.cached_share[index])
    unmeasured = state.pool.table.prefill_unmeasured[index]
    return (work < IDLE_TOKENS) | (work + cost <= bound * tps) | unmeasured


def start_speeds(state: PoolState, now: float, index: slice | np.ndarray) -> np.ndarray:
    """Prefill tokens/s of rows `index` for the start-delay bound: the latency model's
    speed, or the floor the pod's finished requests prove when that is higher. Without
    the floor, a pod whose speed is not learned keeps the slow default, and a fast pod
    was held to `maxStartDelay` x 1,000 tokens in flight (measured: 140 requests/s at
    concurrency 32 through `igw bench --overhead`'s one-token pod, against 2,260 without
    the bound). Pods whose engine exports no prefill signal at all are not bounded
    (`pod_room`).
    """
    return np.maximum(state.speeds(now)[0][index], state.prefill_floor[index])


def pool_slots(state: PoolState, rows: np.ndarray) -> float:
    """Learned batch slots of `rows` together; 0 when any is unknown (then neither the
    pool's requests nor tenants' shares of them are bounded by slots)."""
    slots = state.slot_limits(rows)
    return float(slots.sum()) if len(slots) and bool((slots > 0).all()) else 0.0


def slots_room(state: PoolState, rows: np.ndarray) -> bool:
    """The pool's requests in flight on `rows` are fewer than their learned slots plus
    `slotAllowance` each (always true while any pod's slots are unknown)."""
    slots = pool_slots(state, rows)
    if slots <= 0:
        return True
    allowance = state.pool.config.saturation.slot_allowance * len(rows)
    return float(state.pool.table.inflight[rows].sum()) < slots + allowance


def routable_rows(state: PoolState, now: float) -> np.ndarray:
    """Rows a pick may use: fresh candidates, else (every pod stale: degraded routing)
    ready pods whose scrapes have not failed. Flow control bounds them either way."""
    pool = state.pool
    rows = candidate_pods(pool, now)
    if not rows.any():
        t = pool.table
        rows = t.valid & t.ready & ~t.draining & (t.scrape_failures == 0)
    return np.flatnonzero(rows)


def has_room(state: PoolState, req: SchedulingRequest, now: float) -> bool:
    """Some pod the pick may use can take `req` within the start-delay bound, the pool
    within its slots, and `req`'s tenant is within its share of the slots; True when
    there is no such pod at all (the pick answers 503 then, not the queue)."""
    state.sync()
    rows = routable_rows(state, now)
    if not len(rows):
        return True
    if state.pool.config.saturation.max_start_delay_s > 0 and (
        not slots_room(state, rows)
        or tenant_capped(state, req.tenant, now, shared_slots(state, now, rows))
    ):
        return False
    return bool(pod_room(state, req, now, rows).any())


def free_slots(state: PoolState, req: SchedulingRequest, now: float,
               index: slice | np.ndarray) -> np.ndarray | None:
    """While tenants share the pool's slots (`req`'s tenant and another active, every
    routable pod's slots known): per row of `index`, whether a slot is free, so the pick
    can send `req` where it starts at once. None otherwise: the scorers alone choose."""
    slots = shared_slots(state, now)
    window = state.pool.config.saturation.fair_share_window_s
    if slots <= 0 or state.shares.share(req.tenant, slots, now, window) is None:
        return None
    return state.pool.table.inflight[index] < state.slots[index]


def shared_slots(state: PoolState, now: float, rows: np.ndarray | None = None) -> float:
    """The pool's slots that tenants share (picker.scheduling.shares), or 0 when shares
    cannot bind: turned off, flow control off, fewer than two tenants, slots unknown."""
    sat = state.pool.config.saturation
    if sat.fair_share_window_s <= 0 or sat.max_start_delay_s <= 0 or len(state.shares) < 2:
        return 0.0
    if rows is None:
        state.sync()
        rows = routable_rows(state, now)
    return pool_slots(state, rows)


def tenant_capped(state: PoolState, tenant: str, now: float, slots: float) -> bool:
    """`tenant` holds its whole share of `slots` (from `shared_slots`)."""
    if slots <= 0:
        return False
    return state.shares.capped(tenant, slots, now, state.pool.config.saturation.fair_share_window_s)


@dataclass(frozen=True, slots=True)
class Committed:
    """A pool's committed work, for the gateway's metrics (read when scraped)."""

    requests: float  # the gateway's requests in flight on the pool
    prefill_tokens: float  # uncached prompt tokens sent and not yet prefilled
    # Share of the pool's capacity in use: the largest of committed prefill time over
    # the start-delay budget, requests in flight over learned slots (when every
    # routable pod's are known), and the share of pods saturated by engine signals.
    # 1 or more: new requests wait (a scaler's target is below 1).
    saturation: float


def committed(state: PoolState, now: float) -> Committed:
    """The pool's committed work and saturation now (off the request path)."""
    state.sync()
    pool = state.pool
    t = pool.table
    valid = np.flatnonzero(t.valid)
    tokens = float(committed_tokens(state, valid).sum()) if len(valid) else 0.0
    rows = routable_rows(state, now)
    if not len(rows):
        return Committed(float(t.inflight[valid].sum()), tokens, 1.0 if len(valid) else 0.0)
    bound = pool.config.saturation.max_start_delay_s
    share = float(saturated_pods(pool)[rows].mean())
    if bound > 0:
        slots = pool_slots(state, rows)
        if slots > 0:
            share = max(share, float(t.inflight[rows].sum()) / slots)
        measured = rows[~t.prefill_unmeasured[rows]]  # the others have no start bound
        if len(measured):
            budget = bound * float(start_speeds(state, now, measured).sum())
            share = max(share, float(committed_tokens(state, measured).sum()) / budget)
    return Committed(float(t.inflight[valid].sum()), tokens, share)
