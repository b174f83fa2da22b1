"""Filters: drop the pods that must not get the request.

Order matters only for the reason shown by `explain`: the first filter that
drops a pod names why. Filters never fail a request on their own: when they
leave nothing, the scheduler raises `NoCandidates`, except where a filter says
a softer fallback is better (stale metrics, LoRA).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.datastore import Pool
from picker.scheduling.context import ScoringContext
from picker.scheduling.flow import free_slots, pod_room
from picker.scheduling.plugins import FILTERS, PodFilter

# How long an adapter the gateway sent to a pod is assumed to stay resident there.
ADAPTER_MEMORY_S = 60.0
# Adapter slots in the pool per adapter it serves, at least, for its slots to abound
# (`slots_abound`).
SPARE_SLOTS_PER_ADAPTER = 2.0


@FILTERS.register
class Ready(PodFilter):
    """Pods discovery lists and health considers ready."""

    name: ClassVar[str] = "ready"
    reason: ClassVar[str] = "not-ready"

    def mask(self, pool: Pool, now: float) -> np.ndarray:
        return pool.table.ready


@FILTERS.register
class NotDraining(PodFilter):
    """Pods being drained finish their requests but get no new ones."""

    name: ClassVar[str] = "not-draining"
    reason: ClassVar[str] = "draining"

    def mask(self, pool: Pool, now: float) -> np.ndarray:
        return ~pool.table.draining


@FILTERS.register
class FreshMetrics(PodFilter):
    """Pods whose last scrape succeeded within `metrics.staleAfter`.

    Scores computed from old numbers are wrong in the way that hurts most
    (an overloaded pod looking idle), so stale pods are skipped while any pod
    is fresh. When *every* ready pod is stale (the metrics source is down, not
    the pods) the gateway keeps routing, in degraded mode: least in-flight
    requests by its own count, rather than failing the whole model. Pods whose
    last scrape *failed* stay out even then: with direct scraping a refused or
    timed-out scrape usually means the pod itself is gone (DESIGN §4: a failed
    scrape marks the pod not ready), and a pool of such pods answers 503.
    """

    name: ClassVar[str] = "fresh-metrics"
    reason: ClassVar[str] = "stale-metrics"
    degrade_when_empty: ClassVar[bool] = True

    def mask(self, pool: Pool, now: float) -> np.ndarray:
        t = pool.table
        return t.metrics_ok & (t.scraped_at >= now - pool.config.metrics.stale_after_s)

    def fallback(self, ctx: ScoringContext) -> np.ndarray:
        return ctx.pool.table.scrape_failures[ctx.rows] == 0


@FILTERS.register
class LoraCapable:
    """For an adapter request, drop pods that can take it only by evicting another adapter.

    Kept: pods where the adapter is resident (running) or already queued
    (waiting), pods with a free adapter slot (running adapters < max_lora; where
    the pool's slots abound, adapters sent there lately count as holding a slot
    too, `lora_state`), and pods that report no LoRA information (max_lora == 0:
    unknown, not "none"; SGLang and TensorRT-LLM publish no such metric). If no
    pod qualifies, all are kept: the engine queues the request anyway, and
    failing would be worse. Base-model requests are not filtered.
    """

    name: ClassVar[str] = "lora"
    reason: ClassVar[str] = "lora-no-slot"
    degrade_when_empty: ClassVar[bool] = False

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        state = lora_state(ctx)
        if state is None:
            return np.ones(len(ctx.rows), dtype=bool)
        resident, waiting, free = state
        able = resident | waiting | free
        return able if able.any() else np.ones(len(ctx.rows), dtype=bool)


def lora_state(ctx: ScoringContext) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(resident, waiting, free-slot-or-unknown) per candidate; None for base-model requests.

    An adapter the pool has no slot for (more than `MAX_ADAPTERS` names) has no
    information at all: every pod counts as "free slot".

    A free slot is one no adapter holds. The page counts the adapters of running
    requests only; where the pool's slots abound (`slots_abound`), the adapters the
    gateway sent to a pod within ADAPTER_MEMORY_S hold slots there too, idle or not:
    counted free, such a pod drew other adapters, each load evicting an idle adapter
    that was often its only copy, whose next request then loaded it again
    (family-0-25, vLLM 0.8, 11 adapters in 42 slots: 43 loads against best-ttft's 20
    and adapter-affine's 14, on twin seed 0). Where slots are scarce, evicting an idle
    adapter is the pool's normal way to serve the next one, and counting it as a held
    slot sent requests only to their adapters' homes, however slow (family-0-85, one
    slot on each of 5 pods, 25 adapters: 1.04 -> 2.64x best-ttft).
    """
    if ctx.req.adapter is None:
        return None
    resident, waiting, free = ctx.derived("_lora_state", _lora_state)
    return resident, waiting, free


def _lora_state(ctx: ScoringContext) -> np.ndarray:
    """`lora_state` of an adapter request as one (3, candidates) array, computed once per
    candidate set: the `lora` and `lora-home` filters, `loraAffinity` and the latency model
    all ask, and each asking anew cost an adapter request's pick 6x a base-model one's at
    1,000 pods (bench/results/scoring.md)."""
    n = len(ctx.rows)
    slot = ctx.pool.adapter_index.get(ctx.req.adapter)
    if slot is None:
        none = np.zeros(n, dtype=bool)
        return np.stack((none, none, np.ones(n, dtype=bool)))
    table = ctx.table
    max_lora = ctx.col("max_lora")
    unknown = max_lora <= 0
    # Where the page has no `max_lora`, the slots the pool proved (PoolState.adapter_slots):
    # with 1 there (as before), an adapter whose requests had ended counted as resident only
    # while it was the last one sent, so lora-home found no home and spilled it; 107
    # adapter loads against adapter-affine's 19 on family-0-8 (TensorRT-LLM, 4 slots).
    capacity = adapter_capacity(max_lora, ctx.state.adapter_slots[ctx.index])
    resident = table.lora_running[ctx.index, slot] | _recently_sent(ctx, slot, capacity)
    waiting = table.lora_waiting[ctx.index, slot]
    free = _adapters_held(ctx) < max_lora
    if unknown.any():
        resident, free = _unknown_slots(ctx, slot, unknown, resident, free)
    return np.stack((resident, waiting, free))


def adapter_capacity(max_lora: np.ndarray, proved: np.ndarray) -> np.ndarray:
    """Adapter slots per pod: the page's `max_lora`, else the slots the pool proved
    (PoolState.adapter_slots), at least one."""
    return np.where(max_lora > 0, max_lora, np.maximum(proved, 1.0))


def _unknown_slots(ctx: ScoringContext, slot: int, unknown: np.ndarray, resident: np.ndarray,
                   free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Residency and free slots where the engine says nothing of adapters, from the
    gateway's own accounting: an adapter with requests in flight holds a slot (it is
    resident), and a pod has one free while fewer other adapters are in flight than it
    has proved to run at once (PoolState.adapter_slots, at least one; one more for a
    probe, PoolState.probe_capacity). Counting every
    such pod as free (as before) let `lora-home` spill a new adapter onto pods whose
    slots two running adapters kept busy, where it waited seconds for one (family-0-97,
    SGLang 0.4, 18 adapters on 11 pods of 2 slots: TTFT p95 11.2 s against
    adapter-affine's 0.1 s, 91 adapter loads against 5)."""
    inflight = ctx.state.adapter_inflight[ctx.index, _known(ctx)]
    mine = inflight[:, slot] > 0
    others = np.count_nonzero(inflight, axis=1) - mine
    resident = np.where(unknown, resident | mine, resident)
    # the proved slots and, while no probe is out, one more (PoolState.probe_capacity)
    free = np.where(unknown, others < ctx.state.probe_capacity(ctx.now), free)
    return resident, free


def slots_abound(ctx: ScoringContext) -> bool:
    """The pool's adapter slots (`adapter_capacity` of every pod) number
    SPARE_SLOTS_PER_ADAPTER per adapter it knows, or more."""
    valid = ctx.table.valid
    slots = adapter_capacity(ctx.table.max_lora[valid], ctx.state.adapter_slots[valid]).sum()
    return float(slots) >= SPARE_SLOTS_PER_ADAPTER * len(ctx.pool.adapter_index)


def _adapters_held(ctx: ScoringContext) -> np.ndarray:
    """Adapters holding a slot on each candidate: those of its running requests and, where
    the pool's slots abound, those sent there within ADAPTER_MEMORY_S. Such an adapter,
    idle now, still holds its slot: engines keep adapters resident until a load needs the
    slot, and a vLLM page shows only the adapters of running and waiting requests."""
    known = _known(ctx)
    held = ctx.table.lora_running[ctx.index, known]
    if slots_abound(ctx):
        held = held | _sent_lately(ctx.state.adapter_sent[ctx.index, known], ctx.now)
    return np.count_nonzero(held, axis=1)


def _known(ctx: ScoringContext) -> slice:
    """The LoRA matrices' columns of the adapters the pool knows: they take columns in
    order (`Pool.adapter_slot`) and the rest stay empty, so comparisons over all
    MAX_ADAPTERS columns cost an adapter request's pick 3.6x a base-model one's at 1,000
    pods for a pool of 8 adapters (bench/results/scoring.md)."""
    return slice(0, len(ctx.pool.adapter_index))


def _sent_lately(sent: np.ndarray, now: float) -> np.ndarray:
    """Where `sent` (a time of the gateway's last send, 0 for never) is within
    ADAPTER_MEMORY_S of `now`: the adapter is assumed still resident there."""
    return (sent > now - ADAPTER_MEMORY_S) & (sent > 0)


def _recently_sent(ctx: ScoringContext, slot: int, capacity: np.ndarray) -> np.ndarray:
    """Pods the gateway sent this adapter to lately, where it is still among the
    `capacity` (`adapter_capacity`) most recently sent adapters (engines evict adapters
    LRU)."""
    sent = ctx.state.adapter_sent[ctx.index, _known(ctx)]
    mine = sent[:, slot]
    newer = np.count_nonzero(sent > mine[:, None], axis=1)
    return _sent_lately(mine, ctx.now) & (newer < capacity)


@FILTERS.register
class FlowRoom:
    """Pods that can take the request within `saturation.maxStartDelay`
    (picker.scheduling.flow).

    Admission released the request because some pod has room; this sends it
    to one of those, and while tenants share the pool's batch slots to one
    with a slot free if there is one (a tenant within its share starts at
    once, not behind another's requests in an engine's queue). If none of the
    candidates the earlier filters left has room (LoRA narrowed them), all
    are kept: a filter never fails a request.
    """

    name: ClassVar[str] = "flow-room"
    reason: ClassVar[str] = "no-room"
    degrade_when_empty: ClassVar[bool] = False

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        room = pod_room(ctx.state, ctx.req, ctx.now, ctx.index)
        if not room.any():
            return np.ones(len(ctx.rows), dtype=bool)
        free = free_slots(ctx.state, ctx.req, ctx.now, ctx.index)
        if free is None:
            return room
        free &= room
        return free if free.any() else room
