"""Scheduler semantics: filters, each scorer, profiles, picking, accounting, explain."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from contract.config import MetricsConfig, SaturationConfig, SchedulerConfig
from picker.datastore import Pool
from picker.scheduling import NoCandidates, Scheduler, SchedulingRequest, build_profile
from picker.scheduling.context import ScoringContext
from picker.scheduling.filters import ADAPTER_MEMORY_S
from picker.scheduling.lora_home import HOME_SLACK_S
from picker.scheduling.plugins import SCORERS
from picker.scheduling.profiles import PROFILES, effective_weights
from picker.scheduling.scorers.latency import predicted_ttft
from picker.scheduling.state import speed_classes

NOW = 1_000.0


def make_pool(n: int, profile: str = "llm-d", weights: dict | None = None, **cols) -> Pool:
    """n fresh, ready pods; keyword arguments set datastore columns (lists of n values)."""
    endpoints = tuple(f"10.0.0.{i}:8000" for i in range(n))
    pool = Pool(
        SchedulerConfig(
            name="p", model_name="m", endpoints=endpoints, scheduler=profile,
            weights=weights or {}, lora_adapters=("ad-a", "ad-b", "ad-c"),
        )
    )
    pool.set_members(endpoints)
    for row in range(n):
        pool.mark_scrape(row, True, NOW)
    for name, values in cols.items():
        getattr(pool.table, name)[:n] = values
    return pool


def req(prompt: int = 100, blocks: list[int] | None = None, **kw) -> SchedulingRequest:
    hashes = np.array(blocks or [], dtype=np.uint64)
    return SchedulingRequest(model="m", prompt_tokens=prompt, max_tokens=50,
                             prefix_hashes=hashes, **kw)


def scores(pool: Pool, name: str, request: SchedulingRequest | None = None,
           sched: Scheduler | None = None, **params) -> list:
    """One scorer's scores over all ready pods, as a list aligned with rows (on `sched`'s
    state: what it dispatched; a fresh scheduler by default)."""
    sched = sched or Scheduler(pool, rng=np.random.default_rng(0))
    ctx = ScoringContext(pool, sched.state, request or req(),
                         np.flatnonzero(pool.table.valid), NOW)
    out = SCORERS[name](**params).score(ctx)
    return np.broadcast_to(out, (len(ctx.rows),)).tolist()


# -- scorers -------------------------------------------------------------------------


def test_queue_min_max_with_dispatched_correction():
    pool = make_pool(3, waiting=[4, 0, 2], dispatched=[0, 2, 0])
    # q = waiting + dispatched = 4, 2, 2 -> (4 - q) / (4 - 2)
    assert scores(pool, "queue") == [0.0, 1.0, 1.0]
    assert scores(pool, "queue", gap_correction=False) == [0.0, 1.0, 0.5]


def test_queue_all_equal_and_one_pod_score_one():
    assert scores(make_pool(3, waiting=[5, 5, 5]), "queue") == [1.0, 1.0, 1.0]
    assert scores(make_pool(1, waiting=[9]), "queue") == [1.0]


def test_queue_counts_requests_in_prefill_where_the_page_has_no_prefill_clock():
    """SGLang shows a request in its prefill in neither gauge: the gateway's own requests
    the scrape did not show running count as queued there (pod 0: 5 in flight, 1
    running, 1 sent since: 3 unseen, plus the 1 sent), never below `waiting` + sends
    (pod 1). A page with a prompt counter (pod 2) keeps waiting + sends."""
    pool = make_pool(3, waiting=[0, 4, 1], running=[1, 0, 0], inflight=[5, 5, 5],
                     dispatched=[1, 0, 0])
    pool.table.prompt_tokens_total[:3] = [math.nan, math.nan, 0.0]
    # q = 3 + 1, max(4, 5) + 0, 1 + 0 -> (5 - q) / (5 - 1)
    assert scores(pool, "queue") == [0.25, 0.0, 1.0]
    pool.table.prompt_tokens_total[:2] = 0.0  # every page with a clock: as before
    assert scores(pool, "queue") == [1.0, 0.0, 1.0]  # q = 1, 4, 1


def test_running_requests_counts_dispatched_not_inflight():
    pool = make_pool(3, running=[10, 10, 0], dispatched=[0, 5, 0], inflight=[50, 0, 0])
    assert scores(pool, "runningRequests") == [pytest.approx(1 / 3), 0.0, 1.0]


def test_kv_cache_is_one_minus_usage():
    assert scores(make_pool(2, kv_usage=[0.25, 1.0]), "kvCache") == [0.75, 0.0]


def test_kv_cache_folds_tokens_sent_since_scrape_when_capacity_known():
    pool = make_pool(2, kv_usage=[0.5, 0.5], kv_block_size=[16, 16], kv_num_blocks=[625, 0])
    sched = Scheduler(pool)
    sched.on_dispatch(0, req(prompt=2_000), NOW)
    ctx = ScoringContext(pool, sched.state, req(), np.arange(2), NOW)
    assert SCORERS["kvCache"]().score(ctx).tolist() == pytest.approx([0.3, 0.5])
    sched.on_dispatch(1, req(prompt=2_000), NOW)  # pod 1 publishes no cache size
    ctx = ScoringContext(pool, sched.state, req(), np.arange(2), NOW)
    assert SCORERS["kvCache"]().score(ctx).tolist() == pytest.approx([0.3, 0.5])
    pool.mark_scrape(0, True, NOW + 0.05)  # the scrape now includes that request
    ctx = ScoringContext(pool, sched.state, req(), np.arange(2), NOW)
    assert SCORERS["kvCache"]().score(ctx).tolist() == pytest.approx([0.5, 0.5])


def _lora_pool() -> Pool:
    pool = make_pool(5, max_lora=[2, 2, 1, 2, 0])
    slot_a, slot_b, slot_c = (pool.adapter_slot(a) for a in ("ad-a", "ad-b", "ad-c"))
    t = pool.table
    t.lora_running[0, slot_a] = True  # resident
    t.lora_running[1, slot_b] = True  # one of two slots used: free slot
    t.lora_running[2, slot_b] = True  # the only slot used by another adapter...
    t.lora_waiting[2, slot_a] = True  # ...but ad-a is queued there
    t.lora_running[3, [slot_b, slot_c]] = True  # full, nothing of ad-a
    return pool  # row 4: max_lora 0 = no LoRA information


def test_lora_affinity_levels():
    pool = _lora_pool()
    assert scores(pool, "loraAffinity", req(adapter="ad-a")) == [1.0, 0.8, 0.6, 0.0, 0.8]
    assert scores(pool, "loraAffinity", req()) == [1.0] * 5


def test_lora_affinity_unknown_adapter_counts_as_free_slot():
    pool = _lora_pool()
    assert scores(pool, "loraAffinity", req(adapter="not-tracked")) == [0.8] * 5


def test_without_adapter_metrics_the_gateways_own_requests_say_what_holds_a_slot():
    """SGLang and TensorRT-LLM publish no adapter metrics (max_lora 0): an adapter with
    requests in flight holds a slot there, and only a pod with no other adapter in flight
    surely has one free; a completion gives it back. (With the pool's one slot found by a
    probe, `test_adapter_slots_are_probed_one_adapter_beyond_the_proof`: none is sent.)"""
    pool = make_pool(3, max_lora=[0, 0, 0])
    sched = Scheduler(pool, max_fallbacks=2)
    sched.state.slot_cap = 1.0
    sched.on_dispatch(0, req(adapter="ad-a"), NOW)
    busy = req(adapter="ad-b")
    sched.on_dispatch(1, busy, NOW)
    assert scores(pool, "loraAffinity", req(adapter="ad-a"), sched) == [1.0, 0.0, 0.8]
    assert set(sched.pick(req(adapter="ad-c"), NOW).rows) == {2}
    sched.on_complete(1, busy, NOW + 1, 1.0, ok=True)
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.0, 0.8, 0.8]


def test_without_adapter_metrics_a_pod_proves_its_adapter_slots_by_running_them():
    """Two adapters in flight on a pod whose scrape shows nothing waiting: it runs two at
    once, so while only one other is in flight it has a slot free for a third adapter;
    with two, not while a probe of three slots is out. A scrape with a queue proves
    nothing."""
    pool = make_pool(2, max_lora=[0, 0])
    sched = Scheduler(pool, max_fallbacks=1)
    first, second = req(adapter="ad-a"), req(adapter="ad-b")
    sched.on_dispatch(0, first, NOW)
    sched.on_dispatch(0, second, NOW)
    t = pool.table
    t.running[0], t.waiting[0] = 2, 1
    pool.mark_scrape(0, True, NOW + 0.05)
    sched.on_complete(0, first, NOW + 0.1, 0.1, ok=True)
    assert sched.state.adapter_slots[0] == 0  # a queue: the two may not have run at once
    sched.on_dispatch(0, first, NOW + 0.2)
    t.waiting[0] = 0
    pool.mark_scrape(0, True, NOW + 0.25)
    sched.on_complete(0, first, NOW + 0.3, 0.1, ok=True)
    assert sched.state.adapter_slots[0] == 2
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.8, 0.8]
    sched.on_dispatch(0, first, NOW + 0.4)
    for adapter in ("ad-a", "ad-b", "ad-c"):  # ad-c makes three there: the probe, out
        sched.on_dispatch(1, req(adapter=adapter), NOW + 0.4)
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.0, 1.0]


def test_with_replicas_only_this_replicas_requests_before_the_scrape_prove_adapter_slots():
    """Another replica's request may have ended at the engine a flush before its completion
    arrives, and a shared scrape is written a flush after it was taken: neither proves that
    two adapters ran at once (a 1-slot pool learned 2). This replica's own requests, all
    sent before the scrape was taken, still do."""
    pool = make_pool(1, max_lora=[0])
    sched = Scheduler(pool, max_fallbacks=0)
    t = pool.table
    remote, local = req(adapter="ad-a"), [req(adapter="ad-b"), req(adapter="ad-b")]
    sched.on_remote_dispatch(0, remote, NOW)  # ended at the engine; completion on its way
    for one in local:
        sched.on_dispatch(0, one, NOW + 0.01)
    t.running[0], t.waiting[0] = 2, 0
    pool.mark_scrape(0, True, NOW + 0.05)
    for one in local:
        sched.on_complete(0, one, NOW + 0.1, 0.09, ok=True)
    assert sched.state.adapter_slots[0] == 1  # ad-b ran; ad-a is no proof of a second
    sched.on_remote_complete(0, remote, NOW + 0.1, 0.1, "pod")
    first, second = req(adapter="ad-a"), req(adapter="ad-c")
    sched.on_dispatch(0, first, NOW + 0.2)
    sched.on_dispatch(0, second, NOW + 0.22)
    pool.mark_scrape(0, True, NOW + 0.21)  # a shared result, taken before ad-c was sent
    sched.on_complete(0, first, NOW + 0.3, 0.1, ok=True)
    assert sched.state.adapter_slots[0] == 1  # the scrape never saw ad-c
    sched.on_dispatch(0, first, NOW + 0.4)
    pool.mark_scrape(0, True, NOW + 0.45)
    sched.on_complete(0, first, NOW + 0.5, 0.1, ok=True)
    assert sched.state.adapter_slots[0] == 2


def test_gauges_as_last_set_prove_adapter_slots_only_well_after_the_last_send():
    """SGLang's page shows its gauges as last set (`gauge_age_s`, from the data layer): a
    scrape just after a third adapter was sent may still show the batch before it, with
    nothing waiting, while that adapter waits for a slot (family-0-97: 3 slots learned on
    pods of 2, TTFT p95 3.8 s against best-ttft's 0.1 s). Only a scrape that long after
    the row's last send proves anything there."""
    age = 2.0
    pool = make_pool(1, max_lora=[0], gauge_age_s=[age])
    sched = Scheduler(pool, max_fallbacks=0)
    t = pool.table
    sent = [req(adapter=a) for a in ("ad-a", "ad-b", "ad-c")]
    for one in sent:
        sched.on_dispatch(0, one, NOW)
    t.running[0], t.waiting[0] = 3, 0
    pool.mark_scrape(0, True, NOW + 0.5)
    sched.on_complete(0, sent[0], NOW + 1.0, 1.0, ok=True)
    assert sched.state.adapter_slots[0] == 0
    t.running[0] = 2
    pool.mark_scrape(0, True, NOW + age + 0.1)
    sched.on_complete(0, sent[1], NOW + age + 0.2, 1.0, ok=True)
    assert sched.state.adapter_slots[0] == 2


@pytest.mark.parametrize("remote", [False, True], ids=["own", "another-replicas"])
def test_adapter_slots_are_probed_one_adapter_beyond_the_proof(remote: bool):
    """Where nothing proved a second slot, one request at a time may make a pod's adapters
    in flight one more than proved (else a pool whose requests share one adapter never
    proves more: family-0-92). A scrape with gauges set after it that shows a queue while
    its adapter is in flight disproves that level: it is not probed again.

    With replicas, a send folded from another replica is the probe here as well: this
    replica sends no probe of its own beside it (each noting only its own, N probes went
    out at once on a 1-slot pool: family-0-19 +18 % p95 at N = 4 in the twin), and the
    queue behind it caps the level here too."""
    pool = make_pool(2, max_lora=[0, 0])
    sched = Scheduler(pool, max_fallbacks=1)
    t = pool.table
    sched.on_dispatch(0, req(adapter="ad-a"), NOW)
    sched.on_dispatch(1, req(adapter="ad-a"), NOW)
    assert scores(pool, "loraAffinity", req(adapter="ad-b"), sched) == [0.8, 0.8]
    send = sched.on_remote_dispatch if remote else sched.on_dispatch
    send(0, req(adapter="ad-b"), NOW + 0.01)
    assert sched.explain(req(adapter="ad-c"), NOW + 0.02)["adapter_slots"] == {
        "proved": 0.0, "cap": None, "probe_row": 0, "probe_level": 2.0}
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.0, 0.0]
    t.running[0], t.waiting[0] = 1, 1
    pool.mark_scrape(0, True, NOW + 0.05)
    sched.on_complete(0, req(adapter="ad-a"), NOW + 0.1, 0.1, ok=True)
    assert sched.state.slot_cap == 1.0 and sched.state.probe_at == 0.0
    assert sched.state.probe_capacity(NOW + 0.2) == 1.0
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.0, 0.0]
    assert sched.explain(req(adapter="ad-c"), NOW + 0.2)["adapter_slots"] == {
        "proved": 0.0, "cap": 1.0, "probe_row": None, "probe_level": None}


def test_a_probe_proved_opens_the_next_level():
    """The probe's scrape shows nothing waiting: two slots are proved, and the next probe
    may make a pod's adapters three."""
    pool = make_pool(1, max_lora=[0])
    sched = Scheduler(pool, max_fallbacks=0)
    t = pool.table
    sched.on_dispatch(0, req(adapter="ad-a"), NOW)
    sched.on_dispatch(0, req(adapter="ad-b"), NOW + 0.01)
    assert sched.state.probe_level == 2.0
    t.running[0], t.waiting[0] = 2, 0
    pool.mark_scrape(0, True, NOW + 0.05)
    sched.on_complete(0, req(adapter="ad-a"), NOW + 0.1, 0.1, ok=True)
    assert sched.state.adapter_slots[0] == 2.0 and sched.state.probe_at == 0.0
    assert sched.state.probe_capacity(NOW + 0.2) == 3.0


def test_a_queue_behind_a_forced_send_never_raises_the_cap():
    """Where no pod has a free slot every pod is kept and some pod gets one adapter more
    than the pool proved; a queue behind that at a higher level says the slots are below
    it, which must not undo a lower cap (on a one-slot pool it did, and the probe of a
    second slot was sent again and again: family-0-19)."""
    pool = make_pool(1, max_lora=[0])
    sched = Scheduler(pool, max_fallbacks=0)
    t = pool.table
    sched.state.slot_cap = 1.0
    for adapter in ("ad-a", "ad-b"):  # long running; ad-b's verdict never came
        sched.on_dispatch(0, req(adapter=adapter), NOW - 30)
    sched.on_dispatch(0, req(adapter="ad-c"), NOW)
    assert sched.state.probe_level == 3.0
    t.running[0], t.waiting[0] = 1, 2
    pool.mark_scrape(0, True, NOW + 0.05)
    sched.on_complete(0, req(adapter="ad-a"), NOW + 0.1, 0.1, ok=True)
    assert sched.state.slot_cap == 1.0 and sched.state.probe_at == 0.0


def test_a_proof_beyond_a_probes_cap_lifts_it():
    """A probe's queue may have waited for the batch, not for a slot: two adapters later
    seen running at once with nothing waiting prove the cap wrong, and probing resumes."""
    pool = make_pool(1, max_lora=[0])
    sched = Scheduler(pool, max_fallbacks=0)
    sched.state.slot_cap = 1.0
    _prove_two_adapter_slots(sched, pool)
    assert sched.state.slot_cap == math.inf
    assert sched.state.probe_capacity(NOW + 1) == 3.0


def _prove_two_adapter_slots(sched: Scheduler, pool: Pool) -> None:
    """Pod 0 runs ad-a and ad-b at once under a scrape with nothing waiting."""
    first, second = req(adapter="ad-a"), req(adapter="ad-b")
    sched.on_dispatch(0, first, NOW)
    sched.on_dispatch(0, second, NOW)
    pool.table.running[0], pool.table.waiting[0] = 2, 0
    pool.mark_scrape(0, True, NOW + 0.05)
    sched.on_complete(0, first, NOW + 0.1, 0.1, ok=True)
    sched.on_complete(0, second, NOW + 0.1, 0.1, ok=True)


def test_without_adapter_metrics_a_proof_of_adapter_slots_holds_for_the_whole_pool():
    """The pool's pods run one engine configuration: two adapters proved on pod 0 give
    pod 1, which never ran two at once, a free slot beside one other adapter in flight."""
    pool = make_pool(2, max_lora=[0, 0])
    sched = Scheduler(pool, max_fallbacks=1)
    sched.on_dispatch(1, req(adapter="ad-b"), NOW)
    sched.on_dispatch(1, req(adapter="ad-a"), NOW)  # the probe of a second slot, still out
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.8, 0.0]
    _prove_two_adapter_slots(sched, pool)
    assert sched.state.adapter_slots.tolist()[:2] == [2.0, 2.0]
    assert scores(pool, "loraAffinity", req(adapter="ad-c"), sched) == [0.8, 0.8]


def test_without_adapter_metrics_the_last_proved_slots_worth_of_adapters_sent_stay_resident():
    """Engines evict adapters least recently used: on a pod that runs two at once, the
    last two adapters the gateway sent are resident after their requests end; with no
    proof only the last one is."""
    pool = make_pool(2, max_lora=[0, 0])
    sched = Scheduler(pool, max_fallbacks=1)
    for i, adapter in enumerate(("ad-a", "ad-b")):
        one = req(adapter=adapter)
        sched.on_dispatch(1, one, NOW + i)
        sched.on_complete(1, one, NOW + i + 0.1, 0.1, ok=True)
    assert scores(pool, "loraAffinity", req(adapter="ad-a"), sched)[1] == 0.8
    assert scores(pool, "loraAffinity", req(adapter="ad-b"), sched)[1] == 1.0
    _prove_two_adapter_slots(sched, pool)
    assert scores(pool, "loraAffinity", req(adapter="ad-a"), sched)[1] == 1.0
    assert scores(pool, "loraAffinity", req(adapter="ad-b"), sched)[1] == 1.0


def test_prefix_fraction_of_leading_blocks():
    pool = make_pool(3)
    sched = Scheduler(pool)
    sched.on_dispatch(0, req(blocks=[1, 2, 3, 4]), NOW)
    sched.on_dispatch(1, req(blocks=[1, 2, 9]), NOW)
    ctx = ScoringContext(pool, sched.state, req(blocks=[1, 2, 3, 4]), np.arange(3), NOW)
    assert SCORERS["prefix"]().score(ctx).tolist() == [1.0, 0.5, 0.0]
    empty = ScoringContext(pool, sched.state, req(prompt=0), np.arange(3), NOW)
    assert SCORERS["prefix"]().score(empty) == 0.0


def test_lru_prefers_least_recently_picked_only_without_a_prefix_hit():
    pool = make_pool(3, last_picked_at=[NOW - 1, NOW - 5, NOW - 3])
    assert scores(pool, "lru", req(blocks=[7, 8])) == [0.0, 1.0, 0.5]
    sched = Scheduler(pool)
    sched.on_dispatch(0, req(blocks=[7, 8]), NOW)
    ctx = ScoringContext(pool, sched.state, req(blocks=[7, 8]), np.arange(3), NOW)
    assert SCORERS["lru"]().score(ctx) == 0.0


def test_predicted_latency_fast_short_queue_beats_idle_slow_then_switches():
    # Pod 0: 4x faster, some queue; pod 1: slow and idle.
    pool = make_pool(2, prefill_tps=[20_000, 5_000], decode_step_s=[0.02, 0.02], waiting=[3, 0])
    sched = Scheduler(pool, rng=np.random.default_rng(0), max_fallbacks=0)
    sched.state.mean_prompt = 1_000.0
    request = req(prompt=2_000)
    # fast: (3*1000 + 2000)/20000 = 0.25 s; slow: 2000/5000 = 0.4 s
    assert scores(pool, "predictedLatency", request)[0] == 1.0
    assert sched.pick(request, NOW).rows == (0,)
    pool.table.waiting[0] = 10  # fast: 12000/20000 = 0.6 s > 0.4 s
    assert scores(pool, "predictedLatency", request)[1] == 1.0
    assert sched.pick(request, NOW).rows == (1,)


def test_predicted_latency_counts_only_uncached_prompt():
    pool = make_pool(2, prefill_tps=[10_000, 10_000], decode_step_s=[0.01, 0.01])
    sched = Scheduler(pool)
    blocks = list(range(1, 11))
    sched.on_dispatch(1, req(prompt=1_000, blocks=blocks), NOW)
    pool.mark_scrape(1, True, NOW)  # the request finished; its cache stays
    ctx = ScoringContext(pool, sched.state, req(prompt=1_000, blocks=blocks), np.arange(2), NOW)
    s = SCORERS["predictedLatency"]().score(ctx)
    # pod 0: 1000/10000 + 0.01 = 0.11 s; pod 1: 0 + 0.01 s
    assert s.tolist() == pytest.approx([0.01 / 0.11, 1.0])


def test_predicted_latency_unknown_speed_uses_pool_median_and_observed_speed():
    pool = make_pool(4, prefill_tps=[10_000, 10_000, 10_000, 0], decode_step_s=[0.02] * 4)
    assert scores(pool, "predictedLatency", req(prompt=1_000)) == [1.0] * 4
    sched = Scheduler(pool)
    # The gateway saw pod 3 take twice as long per token as the others.
    for row, duration in ((0, 1.0), (1, 1.0), (3, 2.0)):
        sched.on_complete(row, req(prompt=950), NOW, duration, True)
    tps, _ = sched.state.speeds(NOW)
    assert tps[3] == pytest.approx(5_000)


def _candidate_speeds(pool: Pool, sched: Scheduler, request: SchedulingRequest) -> list:
    ctx = ScoringContext(pool, sched.state, request, np.flatnonzero(pool.table.valid), NOW)
    return ctx.speeds()[0].tolist()


def test_an_untried_idle_pod_is_tried_at_the_fastest_known_speed_once():
    # Pods 0 and 2 slow, pod 1 fast, pod 3 untried: at the median (the slow majority's) it
    # would never be picked, so it would never show its speed.
    pool = make_pool(4, prefill_tps=[2_000, 20_000, 2_000, 0],
                     decode_step_s=[0.04, 0.01, 0.04, 0.0], waiting=[0, 4, 0, 0])
    sched = Scheduler(pool, rng=np.random.default_rng(0), max_fallbacks=0)
    sched.state.mean_prompt = 1_000.0
    assert sched.state.speeds(NOW)[0][3] == 2_000.0
    assert _candidate_speeds(pool, sched, req(prompt=1_000)) == [2_000, 20_000, 2_000, 20_000]
    probe = req(prompt=1_000)
    assert sched.pick(probe, NOW).rows == (3,)  # pod 1's queue: 5000/20000 s ahead
    sched.on_dispatch(3, probe, NOW)
    # In flight: back on the median until it ends, so a slow pod is tried once.
    assert _candidate_speeds(pool, sched, req(prompt=1_000))[3] == 2_000
    assert sched.pick(req(prompt=1_000), NOW).rows != (3,)
    sched.on_complete(3, probe, NOW, 0.5, True)
    assert _candidate_speeds(pool, sched, req(prompt=1_000))[3] == 2_000  # tried: not again
    # An adapter request never probes: it would pay a load and leave its adapter's home.
    fresh = make_pool(4, prefill_tps=[2_000, 20_000, 2_000, 0], decode_step_s=[0.04] * 4)
    assert _candidate_speeds(fresh, Scheduler(fresh), req(adapter="ad-a"))[3] == 2_000
    unknown = make_pool(2)  # nothing known at all: nothing to be optimistic from
    assert _candidate_speeds(unknown, Scheduler(unknown), req()) == [1_000.0, 1_000.0]
    # Nor in the first placements, while under a quarter of the pool is known (2 of 9).
    early = make_pool(9, prefill_tps=[2_000, 20_000] + [0] * 7, decode_step_s=[0.01] * 9)
    assert _candidate_speeds(early, Scheduler(early), req())[3] == 11_000  # the median
    later = make_pool(9, prefill_tps=[2_000, 20_000, 2_000] + [0] * 6, decode_step_s=[0.01] * 9)
    assert _candidate_speeds(later, Scheduler(later), req())[3] == 20_000


def test_an_untried_pod_with_the_kv_capacity_of_known_pods_is_guessed_at_their_speed():
    # Pods 3 and 4 untried: 3 holds the cache of the slow pods 0 and 2 (the same GPU, most
    # likely), so it is not probed as a fast one; 4 matches no known pod: the fastest.
    blocks = [1_000, 8_000, 1_005, 1_002, 4_000]
    pool = make_pool(5, prefill_tps=[2_000, 20_000, 2_200, 0, 0],
                     decode_step_s=[0.04, 0.01, 0.04, 0.0, 0.0],
                     kv_block_size=[16] * 5, kv_num_blocks=blocks)
    sched = Scheduler(pool)
    assert _candidate_speeds(pool, sched, req())[3:] == pytest.approx([2_100, 20_000])
    # Their learned speeds, even stale: a stale pod's own fill is the pool median.
    pool.table.speed_seen_at[:3] = NOW - 60.0
    sched.state.invalidate_speeds()
    assert sched.state.speeds(NOW)[0][0] == 2_200.0
    assert _candidate_speeds(pool, sched, req())[3] == pytest.approx(2_100)


@pytest.mark.parametrize(("slower", "prompt"), [(3.0, 3_000), (1.6, 1_500)])
def test_observed_pace_is_per_output_token_so_generations_stand_apart(
        slower: float, prompt: int) -> None:
    # Pod 1 is the slow generation (3x the time for the same output: an A10G beside an
    # H100; 1.6x: an A100 beside an H100, memory bandwidth) but serves long, cached
    # prompts: per prompt-plus-output token it read several times faster than pods 0 and 2.
    pool = make_pool(3, decode_step_s=[0.0] * 3)
    sched = Scheduler(pool)
    for _ in range(5):
        sched.on_complete(0, req(prompt=100), NOW, 1.0, True)
        sched.on_complete(1, req(prompt=prompt), NOW, slower, True)
        sched.on_complete(2, req(prompt=100), NOW, 1.0, True)
    assert sched.state.observed_pace()[:3].tolist() == pytest.approx(
        [0.02, 0.02 * slower, 0.02])
    tps, step = sched.state.speeds(NOW)
    assert tps[1] == pytest.approx(tps[0] / slower) and step[1] == pytest.approx(step[0] * slower)


def test_observed_pace_of_alike_pods_is_per_output_token_too():
    # Alike pods with unlike prompts read alike per output token; a request that generates
    # nothing (embeddings) is paced by its prompt.
    pool = make_pool(2, decode_step_s=[0.0] * 2)
    sched = Scheduler(pool)
    sched.on_complete(0, req(prompt=100), NOW, 1.0, True)
    sched.on_complete(1, req(prompt=300), NOW, 1.0, True)
    assert sched.state.observed_pace()[:2].tolist() == pytest.approx([1.0 / 50, 1.0 / 50])
    embed = SchedulingRequest("m", None, 400, 0, np.empty(0, np.uint64))
    sched.on_complete(0, embed, NOW, 2.0, True)
    assert sched.state.spot[0] == pytest.approx((1.0 + 0.2 * (2.0 - 1.0)) / (50 + 0.2 * 350))


def test_observed_pace_is_a_ratio_of_averages_so_long_requests_weigh_more():
    """A 2,000-token request in 10 s, then a 60-token one in 1 s: averaged per request the
    pace would jump to 0.2 * 1 / 60 + 0.8 * 10 / 2,000 (2.6x the first); as the ratio of
    the averaged seconds and tokens it moves by what the short request adds."""
    pool = make_pool(1, decode_step_s=[0.0])
    sched = Scheduler(pool)
    empty = np.empty(0, np.uint64)
    sched.on_complete(0, SchedulingRequest("m", None, 0, 2_000, empty), NOW, 10.0, True)
    assert sched.state.spot[0] == pytest.approx(10.0 / 2_000)
    sched.on_complete(0, SchedulingRequest("m", None, 0, 60, empty), NOW, 1.0, True)
    seconds, tokens = 10.0 + 0.2 * (1.0 - 10.0), 2_000 + 0.2 * (60 - 2_000)
    assert sched.state.spot[0] == pytest.approx(seconds / tokens)


def test_speed_classes_pool_similar_pods_and_keep_generations_apart():
    tps = np.array([1_200.0, 9_500.0, 1_510.0, 1_364.0, 0.0, 9_000.0, 1_260.0])
    rows = np.array([0, 1, 2, 3, 5, 6])  # row 4 is not a pod
    out = speed_classes(tps, rows)
    assert out[[0, 2, 3, 6]].tolist() == [1_312.0] * 4  # ±15 % noise: one class, its median
    assert out[[1, 5]].tolist() == [9_250.0] * 2  # 7x faster: a class of its own
    assert out[4] == 0.0
    assert speed_classes(tps, np.array([2])).tolist() == tps.tolist()  # one pod: as learned
    # A pod serving hot cached prompts reads ~1.4x its identical neighbours: one class.
    # An A100 next to A10Gs (2.5x) stays apart.
    cached = speed_classes(np.array([17_940.0, 13_208.0, 13_208.0, 13_208.0]), np.arange(4))
    assert cached.tolist() == [13_208.0] * 4
    apart = speed_classes(np.array([2_600.0, 6_500.0, 2_700.0]), np.arange(3))
    assert apart.tolist() == [2_650.0, 6_500.0, 2_650.0]


def test_speed_classes_form_within_one_kv_capacity_before_across():
    # family-0-18: two A10Gs, two L40S, an A100 (true 1,451 / 3,752 / 3,234 tokens/s).
    # Chained pod by pod, noise bridges the generations: one class.
    tps = np.array([709.0, 966.0, 1_231.0, 1_766.0, 2_026.0])
    capacity = np.array([48_816.0, 48_700.0, 64_080.0, 64_080.0, 283_808.0])  # a few blocks
    rows = np.arange(5)
    assert speed_classes(tps, rows).tolist() == [1_231.0] * 5
    # One capacity, one GPU: each group's median first, then classes across the groups.
    out = speed_classes(tps, rows, capacity)
    assert out[:2].tolist() == [837.5] * 2  # the A10Gs apart, 1.8x under the rest
    assert out[2:].tolist() == [1_498.5] * 3  # L40S and A100 alike, as their truth
    # Alike speeds of unlike caches (an H200 beside H100s, a small model) still join, and a
    # pool whose pages give no cache size (capacity 0) classes as before.
    alike = np.array([24_000.0, 20_000.0, 26_000.0])
    joined = speed_classes(alike, np.arange(3), np.array([8e5, 4e5, 4e5]))
    assert joined.tolist() == [23_000.0] * 3  # the H100s' 23,000 twice, the H200's 24,000
    assert speed_classes(tps, rows, np.zeros(5)).tolist() == [1_231.0] * 5
    # The same cache with speeds apart (an A100-80GB beside an H100) stays apart.
    apart = speed_classes(np.array([3_000.0, 9_000.0, 3_200.0]), np.arange(3), np.full(3, 1e5))
    assert apart.tolist() == [3_100.0, 9_000.0, 3_100.0]


def test_identical_pods_with_noisy_learned_speeds_are_balanced_by_work():
    # The same GPUs, read 1,200 and 1,500 tokens/s: taken at face value the "faster"
    # pod would win with more work queued (1000/1500 = 0.67 s < 900/1200 = 0.75 s).
    pool = make_pool(2, prefill_tps=[1_500, 1_200], decode_step_s=[0.02] * 2, waiting=[1, 0])
    sched = Scheduler(pool)
    sched.on_dispatch(1, req(prompt=900), NOW)
    sched.state.mean_prompt = 1_000.0
    tps, _ = sched.state.speeds(NOW)
    assert tps[0] == tps[1] == pytest.approx(1_350.0)
    ctx = ScoringContext(pool, sched.state, req(prompt=100), np.arange(2), NOW)
    ttft = predicted_ttft(ctx, 256.0)
    assert ttft.tolist() == pytest.approx([1_100 / 1_350 + 0.02, 1_000 / 1_350 + 0.02])


def test_a_busy_engine_s_longer_steps_count_where_its_page_shows_them():
    """TensorRT-LLM: no token counter, so no prefill backlog, and `waiting` near 0 while it
    admits a burst into its steps. Its step length (`iteration_s`, from the iteration
    counter) says the next step will take 0.3 s, not 0.02: an idle twin wins."""
    pool = make_pool(2, prefill_tps=[2_000] * 2, decode_step_s=[0.02] * 2,
                     running=[30, 0], iteration_s=[0.3, 0.0])
    sched = Scheduler(pool)
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(2), NOW)
    ttft = predicted_ttft(ctx, 256.0)
    assert ttft.tolist() == pytest.approx([0.1 + 0.3, 0.1 + 0.02])
    assert sched.pick(req(prompt=200), NOW).rows[0] == 1
    pool.table.iteration_s[0] = 0.01  # shorter than a plain step: the step stands
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(2), NOW)
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx([0.12, 0.12])


def test_a_pod_serving_cached_prefixes_does_not_look_faster_than_its_twins():
    """Three H100s; the engine counted cached prefix tokens as prompt tokens, so the hot
    one read 3x the others (family-0-95). A pod whose share of uncached tokens is under the
    pool's median is slowed by that proportion (never sped up): one speed class again."""
    pool = make_pool(4, prefill_tps=[18_000, 54_000, 20_000, 2_000],
                     prefill_tps_uncached=[16_000, 17_000, 16_500, 2_000],
                     raw_cache_queries=[9e5] * 4, decode_step_s=[0.02] * 4)
    tps, _ = Scheduler(pool).state.speeds(NOW)
    ref = (16_000 / 18_000 + 16_500 / 20_000) / 2  # the median ratio of uncached to raw
    corrected = [18_000, 17_000 / ref, 16_500 / ref]  # the first is over the median: as is
    assert tps[0] == tps[1] == tps[2] == pytest.approx(sorted(corrected)[1])  # one class
    assert tps[3] == 2_000  # a generation apart still


def test_without_cached_prompt_tokens_learned_speeds_are_used_as_they_are():
    pool = make_pool(2, prefill_tps=[2_000, 20_000], prefill_tps_uncached=[2_000, 20_000],
                     raw_cache_queries=[9e5] * 2, decode_step_s=[0.02] * 2)
    assert Scheduler(pool).state.speeds(NOW)[0].tolist()[:2] == [2_000, 20_000]


def test_without_engine_cache_counters_the_gateways_own_cached_share_corrects_speeds():
    """SGLang's page counts no prefix-cache hits: the share of each pod's prompts the
    gateway expected cached (its prefix index at dispatch) stands in."""
    pool = make_pool(2, prefill_tps=[12_000, 30_000], decode_step_s=[0.02] * 2)
    sched = Scheduler(pool)
    sched.state.cached_share[:2] = [0.5, 0.8]
    tps, _ = sched.state.speeds(NOW)
    # uncached 6k and 6k, at the median ratio 0.35: an estimate is scaled both ways
    assert tps[0] == tps[1] == pytest.approx(6_000 / 0.35)


def _system_prompt_pool(other_roots: int) -> tuple[Pool, Scheduler, SchedulingRequest]:
    """Two A10G-like pods whose learned speed counts cached tokens (13k tokens/s, 1.3k
    uncached); pod 0 holds a 10-block system prompt, pod 1 served `other_roots` requests of
    other prompts; both scraped since with nothing ahead. Returns a request of the system
    prompt with an 11th block of its own."""
    pool = make_pool(2, prefill_tps=[13_000] * 2, prefill_tps_uncached=[1_300] * 2,
                     raw_cache_queries=[9e5] * 2, decode_step_s=[0.2, 0.05])
    sched = Scheduler(pool)
    for row in range(2):
        _scrape(pool, row, NOW, 0.0)
    blocks = list(range(1, 11))
    sched.on_dispatch(0, req(prompt=2_000, blocks=blocks), NOW)
    for i in range(other_roots):
        sched.on_dispatch(1, req(prompt=100, blocks=[1_000 + i]), NOW)
    _scrape(pool, 0, NOW + 0.5, 2_000.0)
    _scrape(pool, 1, NOW + 0.5, 100.0 * other_roots)
    return pool, sched, req(prompt=2_000, blocks=[*blocks, 99])


def test_a_prompt_its_holder_can_carry_is_priced_at_the_uncached_speed_elsewhere():
    """The learned speed counts cached prompt tokens: on the published prefix fleet's A10Gs
    13.4k tokens/s against 1.2-1.5k uncached. At the counted speed a cold pod's 2,000-token
    prefill looked 0.15 s + a step (0.20 s), sooner than the prompt's holder with its long
    steps (0.21 s), and the gateway copied hot prompts to cold pods, each copy a 1.1 s
    prefill in the p95 tail. Where the prompt is a tenth of the pool's requests, one holder
    of two pods can carry it: priced at the uncached speed, the holder keeps it."""
    pool, sched, asked = _system_prompt_pool(other_roots=9)
    ctx = ScoringContext(pool, sched.state, asked, np.arange(2), NOW + 0.5)
    own = 2_000 / 11  # the holder prefills only the question
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx(
        [own / 1_300 + 0.2, 2_000 / 1_300 + 0.05])
    assert sched.state.uncached_speed_ratio() == pytest.approx(0.1)
    assert sched.pick(asked, NOW + 0.5).rows[0] == 0
    pool.table.waiting[0] = 6  # a queue on the holder: still sooner than a cold prefill
    assert sched.pick(asked, NOW + 0.5).rows[0] == 0


def test_a_prompt_that_outgrows_its_holders_is_copied_at_the_counted_speed():
    """The same prompt as every request of the pool: one holder of two pods cannot carry
    it, a copy serves the requests that follow, and the copy keeps the counted speed, so an
    idle pod takes it once the holder queues (over 192 s the published prefix plan's p95
    was 0.60 s with every copy at the uncached speed, 0.55 s so)."""
    pool, sched, asked = _system_prompt_pool(other_roots=0)
    ctx = ScoringContext(pool, sched.state, asked, np.arange(2), NOW + 0.5)
    own = 2_000 / 11
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx(
        [own / 13_000 + 0.2, 2_000 / 13_000 + 0.05])
    assert sched.pick(asked, NOW + 0.5).rows[0] == 0  # close: prefix affinity keeps it
    pool.table.waiting[0] = 6  # six prompts queued on the holder: the idle pod copies it
    assert sched.pick(asked, NOW + 0.5).rows[0] == 1


def test_a_pod_that_missed_the_cached_prompts_is_priced_at_its_own_uncached_speed():
    """Three like pods: two learned 12k tokens/s with most prompts cached (4.6k uncached),
    the third missed the warm-up and learned 5.6k, every token of it uncached. Times the
    pool's ratio (0.38) the third was discounted twice, 2.1k a token to compute, and a new
    prompt predicted there at 2.6x its true time (family-0-63: it took 18 of 300 requests
    and never warmed). Its own uncached speed is the floor; the others keep the pool's."""
    pool = make_pool(3, prefill_tps=[12_000, 12_000, 5_600],
                     prefill_tps_uncached=[4_600, 4_600, 5_600],
                     raw_cache_queries=[9e5] * 3, decode_step_s=[0.03] * 3)
    sched = Scheduler(pool)
    for row in range(3):
        _scrape(pool, row, NOW, 0.0)
    ctx = ScoringContext(pool, sched.state, req(prompt=4_000, blocks=[7]), np.arange(3), NOW)
    ratio = 4_600 / 12_000
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx(
        [4_000 / (12_000 * ratio) + 0.03] * 2 + [4_000 / 5_600 + 0.03])
    assert sched.pick(req(prompt=4_000, blocks=[7]), NOW).rows[0] == 2


def test_the_backlog_is_the_latest_sends_in_tokens_to_compute():
    """A long new prompt behind ten cached system prompts: the pod's expected cached share
    (an average of its sends) read it as a fraction of its size; the backlog is the latest
    sends, so it is that prompt, all of it to compute, at the speed of tokens to compute
    (family-0-27: an H100 predicted 0.16 s behind a 7,364-token prompt sent 40 ms before,
    and took 0.67 s)."""
    pool = make_pool(2, prefill_tps=[10_000] * 2, prefill_tps_uncached=[2_000] * 2,
                     raw_cache_queries=[1e6] * 2, decode_step_s=[0.02] * 2)
    sched = Scheduler(pool)
    for row in range(2):
        _scrape(pool, row, NOW, 0.0)
    for _ in range(10):
        sched.on_dispatch(0, req(prompt=2_000), NOW, cached=0.9)
    sched.on_dispatch(0, req(prompt=7_000), NOW + 0.01, cached=0.0)
    _scrape(pool, 0, NOW + 0.05, 20_000.0)  # the ten prefilled, the long one not
    _scrape(pool, 1, NOW + 0.05, 0.0)
    assert sched.state.prefill_backlog()[:2].tolist() == [7_000.0, 0.0]
    assert sched.state.backlog_uncached_work(slice(0, 2)).tolist() == [7_000.0, 0.0]
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(2), NOW + 0.05)
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx(
        [(7_000 + 200) / 2_000 + 0.02, 200 / 2_000 + 0.02])
    # sent since the scrape: each send's uncached part, whatever the pod's average
    sched.on_dispatch(1, req(prompt=3_000), NOW + 0.06, cached=0.0)
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(2), NOW + 0.06)
    assert predicted_ttft(ctx, 256.0)[1] == pytest.approx((3_000 + 200) / 2_000 + 0.02)


def test_predicted_latency_batch_slot_wait():
    pool = make_pool(2, prefill_tps=[10_000] * 2, decode_step_s=[0.02] * 2, running=[256, 100])
    s = scores(pool, "predictedLatency", req(prompt=100), batch_capacity=256)
    # pod 1: 100/10000 + 0.02 = 0.03 s; pod 0 (full batch) waits one slot:
    # + 1 × 0.02 s × 256 mean output tokens / 256 slots = 0.05 s
    assert s == pytest.approx([0.6, 1.0])


# -- filters, candidates, degraded mode -------------------------------------------------


def test_filters_drop_not_ready_draining_and_stale():
    pool = make_pool(4)
    t = pool.table
    t.ready[0] = False
    t.draining[1] = True
    t.scraped_at[2] = NOW - pool.config.metrics.stale_after_s - 1
    sched = Scheduler(pool, max_fallbacks=3)
    assert sched.pick(req(), NOW).rows == (3,)
    explain = sched.explain(req(), NOW)
    reasons = {p["row"]: p["filtered_reason"] for p in explain["pods"]}
    assert reasons == {0: "not-ready", 1: "draining", 2: "stale-metrics", 3: ""}


def test_failed_scrape_is_stale():
    pool = make_pool(2)
    pool.mark_scrape(0, False, NOW)
    assert Scheduler(pool, max_fallbacks=1).pick(req(), NOW).rows == (1,)


def test_all_stale_routes_degraded_on_gateway_inflight():
    pool = make_pool(3, inflight=[2, 0, 1], waiting=[0, 50, 0])
    pool.table.metrics_ok[:3] = False
    pick = Scheduler(pool, max_fallbacks=2).pick(req(), NOW)
    assert pick.degraded and pick.rows == (1, 2, 0)


def test_zero_candidates_raises_with_reasons():
    pool = make_pool(3)
    pool.table.ready[:2] = False
    pool.table.draining[2] = True
    with pytest.raises(NoCandidates) as err:
        Scheduler(pool).pick(req(), NOW)
    assert err.value.reasons == Counter({"not-ready": 2, "draining": 1})
    with pytest.raises(NoCandidates):
        Scheduler(make_pool(0)).pick(req(), NOW)


def test_lora_filter_drops_pods_without_a_slot_unless_none_can():
    pool = _lora_pool()
    sched = Scheduler(pool, max_fallbacks=4)
    assert 3 not in sched.pick(req(adapter="ad-a"), NOW).rows
    assert len(sched.pick(req(), NOW).rows) == 5  # base model: no LoRA filtering
    pool.table.lora_running[:4] = True  # every slot full with other adapters...
    pool.table.max_lora[4] = 1  # ...and the no-info pod now reports a full slot too
    pool.table.lora_waiting[:] = False
    assert len(sched.pick(req(adapter="ad-c2"), NOW).rows) == 5


def test_lora_home_keeps_an_adapter_where_it_is_while_that_costs_little():
    pool = _lora_pool()  # ad-a resident on row 0, queued on row 2
    sched = Scheduler(pool, max_fallbacks=4)
    assert set(sched.pick(req(adapter="ad-a"), NOW).rows) == {0, 2}
    assert len(sched.pick(req(), NOW).rows) == 5  # base model: no LoRA filtering
    reasons = Counter(p["filtered_reason"] for p in sched.explain(req(adapter="ad-a"),
                                                                  NOW)["pods"])
    assert reasons == {"": 2, "lora-no-slot": 1, "lora-not-home": 2}
    # both homes far behind the others (seconds of queued prefill): spill
    pool.table.waiting[[0, 2]] = 200
    ctx = ScoringContext(pool, sched.state, req(adapter="ad-a"), np.array([0, 1, 2, 4]), NOW)
    ttft = predicted_ttft(ctx, 256)
    assert ttft[[0, 2]].min() > ttft.min() + HOME_SLACK_S
    assert set(sched.pick(req(adapter="ad-a"), NOW).rows) == {0, 1, 2, 4}


def test_lora_home_has_no_slack_against_a_free_slot_while_slots_abound():
    """8 slots for 3 adapters: a pod with a free slot churns nothing, so a home a little
    slower than it (less than HOME_SLACK_S) no longer keeps the request; with 5 adapters
    for the same 8 slots, a spill would take a slot a homeless adapter needs: home kept."""
    pool = _lora_pool()  # ad-a resident on row 0, queued on row 2; row 1 has a free slot
    sched = Scheduler(pool, max_fallbacks=4)
    pool.table.waiting[[0, 2]] = 1
    ctx = ScoringContext(pool, sched.state, req(adapter="ad-a"), np.array([0, 1, 2, 4]), NOW)
    ttft = predicted_ttft(ctx, 256)
    assert ttft[1] < ttft[[0, 2]].min() <= ttft.min() + HOME_SLACK_S
    assert set(sched.pick(req(adapter="ad-a"), NOW).rows) == {0, 1, 2, 4}
    for adapter in ("ad-d", "ad-e"):
        pool.adapter_slot(adapter)
    assert set(sched.pick(req(adapter="ad-a"), NOW).rows) == {0, 2}


def test_adapters_sent_lately_hold_their_slots_where_slots_abound():
    """The page shows the adapters of running requests only. Where the pool's slots abound,
    an adapter the gateway sent to a pod lately still holds its slot there, idle or not:
    loading another would evict it, so the pod has no free slot. Where slots are scarce,
    evicting an idle adapter is how the pool serves the next one: the pod stays free."""
    pool = make_pool(3, max_lora=[2, 2, 2])  # 6 slots for 3 adapters (ad-a, ad-b, ad-c)
    sched = Scheduler(pool, max_fallbacks=2)
    for adapter in ("ad-b", "ad-c"):  # both of row 0's slots, idle by the scrape
        sent = req(adapter=adapter)
        sched.on_dispatch(0, sent, NOW - 5.0)
        sched.on_complete(0, sent, NOW - 4.0, 1.0, True)

    def no_slot(now: float) -> set[int]:
        pods = sched.explain(req(adapter="ad-a"), now)["pods"]
        return {p["row"] for p in pods if p["filtered_reason"] == "lora-no-slot"}

    assert no_slot(NOW) == {0}
    assert no_slot(NOW + ADAPTER_MEMORY_S) == set()  # long unused: no longer counted
    pool.adapter_slot("ad-d")  # 4 adapters for 6 slots: scarce
    assert no_slot(NOW) == set()


# -- picking --------------------------------------------------------------------------


def test_pick_returns_distinct_fallbacks_best_first():
    pool = make_pool(5, waiting=[4, 0, 3, 1, 2])
    pick = Scheduler(pool, max_fallbacks=2, rng=np.random.default_rng(0)).pick(req(), NOW)
    assert pick.rows == (1, 3, 4)
    assert pick.addresses == ("10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000")
    assert list(pick.scores) == sorted(pick.scores, reverse=True)


def test_fallbacks_capped_by_candidates_and_single_pod():
    assert len(Scheduler(make_pool(2), max_fallbacks=5).pick(req(), NOW).rows) == 2
    assert Scheduler(make_pool(1), max_fallbacks=2).pick(req(), NOW).rows == (0,)


def test_ties_broken_at_random_and_seeded():
    pool = make_pool(4)
    firsts = Counter(
        Scheduler(pool, max_fallbacks=0, rng=np.random.default_rng(seed)).pick(req(), NOW).rows[0]
        for seed in range(400)
    )
    assert set(firsts) == {0, 1, 2, 3} and min(firsts.values()) > 60
    a = [Scheduler(pool, rng=np.random.default_rng(7)).pick(req(), NOW).rows for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_burst_between_scrapes_spreads_instead_of_herding():
    """N picks inside one scrape interval: the in-flight correction spreads them
    (scoring alone: flow control, which would spread them too, is off)."""
    pool = make_pool(8, waiting=[0, 1, 1, 1, 1, 1, 1, 1])  # pod 0 looks best to every scrape
    no_flow = SaturationConfig(max_start_delay_s=0.0)
    for profile, expect_spread in (("llm-d", True), ("epp", False)):
        pool.config = SchedulerConfig(name="p", model_name="m", endpoints=(), scheduler=profile,
                                      saturation=no_flow)
        for row in range(8):
            pool.mark_scrape(row, True, NOW)
        sched = Scheduler(pool, max_fallbacks=0, rng=np.random.default_rng(1))
        counts = Counter()
        for _ in range(32):
            request = req(prompt=500)
            row = sched.pick(request, NOW).rows[0]
            sched.on_dispatch(row, request, NOW)
            counts[row] += 1
        if expect_spread:
            assert len(counts) == 8 and max(counts.values()) <= 6
        else:
            assert counts == Counter({0: 32})  # the reference herds on stale numbers


def test_same_prefix_sticks_while_not_overloaded_then_moves():
    pool = make_pool(4, prefill_tps=[10_000] * 4, decode_step_s=[0.02] * 4)
    sched = Scheduler(pool, max_fallbacks=0, rng=np.random.default_rng(3))
    blocks = list(range(100, 228))  # 128 blocks, ~2k tokens
    first = sched.pick(req(prompt=2_000, blocks=blocks), NOW).rows[0]
    sched.on_dispatch(first, req(prompt=2_000, blocks=blocks), NOW)
    pool.mark_scrape(first, True, NOW)
    for i in range(5):  # same system prompt + different tails
        request = req(prompt=2_000, blocks=blocks[:120] + [10_000 + i] * 8)
        assert sched.pick(request, NOW).rows[0] == first
    pool.table.waiting[first] = 12  # now its queue outweighs the cache hit
    pool.table.kv_usage[first] = 0.95
    assert sched.pick(req(prompt=2_000, blocks=blocks), NOW).rows[0] != first


# -- accounting ------------------------------------------------------------------------


def test_dispatch_and_complete_account_work_never_below_zero():
    pool = make_pool(2)
    sched = Scheduler(pool)
    r = SchedulingRequest("m", None, 300, 40, np.empty(0, np.uint64))
    sched.on_dispatch(1, r, NOW + 1)
    t = pool.table
    assert (t.inflight[1], t.dispatched[1], t.picks[1]) == (1, 1, 1)
    assert (t.outstanding_prefill[1], t.outstanding_decode[1], t.last_picked_at[1]) == (
        300, 40, NOW + 1)
    sched.on_complete(1, r, NOW + 2, 1.0, True)
    sched.on_complete(1, r, NOW + 2, 1.0, True)  # a duplicate end must not go negative
    assert (t.inflight[1], t.outstanding_prefill[1], t.outstanding_decode[1]) == (0, 0, 0)
    # It ended before any scrape saw it: it will never show in `waiting`, so the
    # since-scrape count drops too (never below zero on the duplicate end).
    assert t.dispatched[1] == 0
    assert sched.state.spot[1] == pytest.approx(1.0 / 40)


def test_completion_seen_by_a_scrape_leaves_the_scrape_count_alone():
    pool = make_pool(2)
    sched = Scheduler(pool)
    r = SchedulingRequest("m", None, 300, 40, np.empty(0, np.uint64))
    sched.on_dispatch(1, r, NOW + 1)
    sched.on_dispatch(1, r, NOW + 1)
    pool.mark_scrape(1, True, now=NOW + 1.5)  # the scrape saw both; zeroes the count
    sched.on_dispatch(1, r, NOW + 1.6)  # one more since that scrape
    sched.on_complete(1, r, NOW + 2, 1.0, True)  # dispatched at NOW + 1: seen by the scrape
    assert pool.table.dispatched[1] == 1


def test_complete_for_a_reused_row_is_ignored_when_address_given():
    pool = make_pool(2)
    sched = Scheduler(pool)
    sched.on_dispatch(0, req(), NOW)
    sched.on_complete(0, req(), NOW, 1.0, True, address="10.9.9.9:1")
    assert pool.table.inflight[0] == 1


def test_listeners_called_on_dispatch_and_complete():
    pool = make_pool(1)
    sched = Scheduler(pool)
    calls = []
    sched.add_listener(lambda: calls.append(1))
    sched.on_dispatch(0, req(), NOW)
    sched.on_complete(0, req(), NOW, 0.1, False)
    assert len(calls) == 2


# -- profiles -------------------------------------------------------------------------


def test_profiles_cover_config_names_and_weights_override():
    assert set(PROFILES) == {"llm-d", "epp", "least-request", "round-robin", "random"}
    assert effective_weights("epp") == {"queue": 2.0, "kvCache": 2.0, "prefix": 3.0}
    w = effective_weights("epp", {"prefix": 0, "lru": 1.5})
    assert w == {"queue": 2.0, "kvCache": 2.0, "lru": 1.5}
    assert set(effective_weights("llm-d")) == {
        "predictedLatency", "prefix", "queue", "kvCache", "loraAffinity", "runningRequests", "lru"}
    assert effective_weights("round-robin", {"queue": 5}) == {}
    with pytest.raises(ValueError, match="unknown scheduler profile"):
        build_profile("nope")


def test_user_weights_change_the_pick():
    pool = make_pool(2, waiting=[0, 5], kv_usage=[0.9, 0.0])
    by_queue = Scheduler(make_pool(2, "epp", {"kvCache": 0}, waiting=[0, 5], kv_usage=[0.9, 0]))
    by_kv = Scheduler(make_pool(2, "epp", {"queue": 0}, waiting=[0, 5], kv_usage=[0.9, 0]))
    assert by_queue.pick(req(), NOW).rows[0] == 0
    assert by_kv.pick(req(), NOW).rows[0] == 1
    assert Scheduler(pool).profile.name == "llm-d"


def test_round_robin_cycles_over_candidates():
    pool = make_pool(3, profile="round-robin", waiting=[100, 0, 0])
    sched = Scheduler(pool, max_fallbacks=1)
    picks = [sched.pick(req(), NOW).rows for _ in range(4)]
    assert picks == [(0, 1), (1, 2), (2, 0), (0, 1)]


def test_least_request_picks_min_inflight_with_random_ties():
    pool = make_pool(4, profile="least-request", inflight=[3, 1, 1, 2], waiting=[0, 9, 9, 0])
    firsts = Counter(
        Scheduler(pool, max_fallbacks=0, rng=np.random.default_rng(s)).pick(req(), NOW).rows[0]
        for s in range(100)
    )
    assert set(firsts) == {1, 2}


def test_random_profile_spreads_over_candidates():
    pool = make_pool(4, profile="random")
    sched = Scheduler(pool, max_fallbacks=3, rng=np.random.default_rng(0))
    picks = [sched.pick(req(), NOW).rows for _ in range(200)]
    assert all(sorted(p) == [0, 1, 2, 3] for p in picks)
    assert len(Counter(p[0] for p in picks)) == 4


def test_reconfigure_keeps_learned_state():
    pool = make_pool(2)
    sched = Scheduler(pool)
    sched.on_dispatch(1, req(blocks=[5, 6]), NOW)
    sched.reconfigure(SchedulerConfig(name="p", model_name="m", endpoints=(), scheduler="epp",
                                      metrics=MetricsConfig()), max_fallbacks=0)
    assert sched.profile.name == "epp" and sched.max_fallbacks == 0
    assert sched.state.prefix.pod_blocks(1) == 2
    sched.reconfigure(pool)
    assert sched.state.prefix.pod_blocks(1) == 2


def test_row_reuse_and_growth_reset_gateway_state():
    pool = make_pool(2)
    sched = Scheduler(pool)
    sched.on_dispatch(0, req(blocks=[1, 2]), NOW)
    pool.remove_pod("10.0.0.0:8000")
    pool.add_pod("10.0.0.99:8000")  # takes row 0 again
    pool.mark_scrape(0, True, NOW)
    for i in range(40):  # grows the table past its initial capacity
        pool.add_pod(f"10.1.0.{i}:8000")
        pool.mark_scrape(pool.pods[f"10.1.0.{i}:8000"].row, True, NOW)
    pick = sched.pick(req(blocks=[1, 2]), NOW)
    assert sched.state.prefix.pod_blocks(0) == 0
    assert len(sched.state.spot) == pool.table.capacity
    assert pick.rows[0] in {p.row for p in pool.pods.values()}


# -- explain --------------------------------------------------------------------------


def test_explain_lists_scores_weights_and_changes_nothing():
    pool = make_pool(3, waiting=[0, 2, 4])
    pool.table.ready[2] = False
    sched = Scheduler(pool, max_fallbacks=1)
    before = pool.table.picks.copy()
    out = sched.explain(req(), NOW)
    assert (pool.table.picks == before).all()
    assert out["profile"] == "llm-d" and out["pool"] == "p" and out["model"] == "m"
    assert out["picked"] == ["10.0.0.0:8000", "10.0.0.1:8000"]
    first = out["pods"][0]
    assert set(first["scores"]) == set(out["weights"])
    total = sum(out["weights"][k] * v for k, v in first["scores"].items())
    assert first["total"] == pytest.approx(total)
    assert first["predicted_ttft_s"] > 0
    assert out["pods"][-1] == {"address": "10.0.0.2:8000", "row": 2, "total": 0.0,
                               "scores": {}, "filtered_reason": "not-ready"}


@pytest.mark.parametrize(("n", "outgrown"), [(7, False), (60, False), (7, True)])
def test_vectorized_scores_equal_the_pure_python_twin(n, outgrown):
    """bench.bench_scoring's per-pod loop implementation agrees pod by pod; `outgrown`: the
    request's prompt root is held by one pod and takes most of the pool's requests."""
    from bench.bench_scoring import _python_inputs, _python_score, build_pool

    pool, sched, request, now = build_pool(n, seed=n)
    if outgrown:
        for row in range(n):
            if row != n // 2:
                sched.state.prefix.forget(row)
        for _ in range(50):
            sched.state.demand.record(int(request.prefix_hashes[0]), now)
    pool.table.dispatched[: n // 2] = 1  # exercise the since-scrape path too
    sched.state.since_tokens[: n // 2] = 300
    sched.state.since_uncached[: n // 2] = 120
    sched.state.since_stamp[:n] = pool.table.scraped_at[:n]
    explain = sched.explain(request, now)
    ours = {p["row"]: p["total"] for p in explain["pods"] if not p["filtered_reason"]}
    row, totals = _python_score(_python_inputs(pool, sched), request, now)
    assert [ours[r] for r in sorted(ours)] == pytest.approx(totals, rel=1e-9)
    assert ours[row] == pytest.approx(max(ours.values()))


# -- prefill backlog and latency-gated tie-breakers ----------------------------------------


def _scrape(pool: Pool, row: int, at: float, prompt_counter: float) -> None:
    pool.table.prompt_tokens_total[row] = prompt_counter
    pool.mark_scrape(row, True, at)


def test_prefill_backlog_counts_sent_tokens_the_engine_has_not_prefilled():
    pool = make_pool(2, prefill_tps=[1_000, 1_000], decode_step_s=[0.01, 0.01])
    sched = Scheduler(pool)
    _scrape(pool, 0, NOW, 5_000.0)
    _scrape(pool, 1, NOW, 5_000.0)
    for _ in range(3):
        sched.on_dispatch(0, req(prompt=400), NOW)
    # the engine admitted all three (running, not waiting) and prefilled one
    _scrape(pool, 0, NOW + 0.05, 5_400.0)
    _scrape(pool, 1, NOW + 0.05, 5_000.0)
    assert sched.state.prefill_backlog()[:2].tolist() == [800.0, 0.0]
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(2), NOW + 0.05)
    ttft = predicted_ttft(ctx, 256.0)
    # pod 0: (800 + 200) / 1000 + 0.01; pod 1: 200 / 1000 + 0.01
    assert ttft.tolist() == pytest.approx([1.01, 0.21])
    _scrape(pool, 0, NOW + 0.1, 6_200.0)  # both prefilled
    assert sched.state.prefill_backlog()[0] == 0.0


def test_prefill_backlog_clamped_by_unfinished_work_restart_and_missing_counter():
    pool = make_pool(1)
    sched = Scheduler(pool)
    _scrape(pool, 0, NOW, 100.0)
    sched.on_dispatch(0, req(prompt=300), NOW)
    _scrape(pool, 0, NOW + 0.05, 100.0)
    assert sched.state.prefill_backlog()[0] == 300.0
    sched.on_complete(0, req(prompt=300), NOW + 0.06, 0.06, False)  # failed, never prefilled
    _scrape(pool, 0, NOW + 0.1, 100.0)
    assert sched.state.prefill_backlog()[0] == 0.0  # nothing unfinished: nothing ahead
    sched.on_dispatch(0, req(prompt=500), NOW + 0.1)
    _scrape(pool, 0, NOW + 0.15, 20.0)  # counter went down: the pod restarted
    assert sched.state.prefill_backlog()[0] == 480.0
    sched.on_dispatch(0, req(prompt=500), NOW + 0.15)
    _scrape(pool, 0, NOW + 0.2, math.nan)  # engine without the counter: no information
    assert sched.state.prefill_backlog()[0] == 0.0



def test_requests_a_page_without_prefill_clock_does_not_show_running_count_as_work_ahead():
    """SGLang counts prompt tokens when a request finishes, and a request in its prefill
    is in neither of its gauges: the gateway's own requests the scrape did not show
    running are work ahead. A page with a prompt counter keeps its backlog."""
    pool = make_pool(3, prefill_tps=[1_000] * 3, decode_step_s=[0.01] * 3)
    sched = Scheduler(pool)
    for row in range(3):
        _scrape(pool, row, NOW, math.nan if row < 2 else 0.0)
    for row in (0, 2):
        for _ in range(3):
            sched.on_dispatch(row, req(prompt=400), NOW)
    pool.table.running[[0, 2]] = 1.0  # one of the three decoding, two in their prefill
    _scrape(pool, 0, NOW + 0.05, math.nan)
    _scrape(pool, 1, NOW + 0.05, math.nan)
    _scrape(pool, 2, NOW + 0.05, 400.0)
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(3), NOW + 0.05)
    # pods 0 and 2: (2 x 400 + 200) / 1000 + 0.01, from the unseen two and the counter
    assert predicted_ttft(ctx, 256.0).tolist() == pytest.approx([1.01, 0.21, 1.01])
    assert sched.state.unseen_requests(slice(2, 3)) is None
    sched.on_dispatch(1, req(prompt=400), NOW + 0.06)  # sent since the scrape: counted once
    ctx = ScoringContext(pool, sched.state, req(prompt=200), np.arange(3), NOW + 0.06)
    assert predicted_ttft(ctx, 256.0)[1] == pytest.approx(0.61)


def test_a_page_without_prefill_clock_is_busy_through_the_uncached_prompts_sent_to_it():
    """SGLang's gauges do not show a prefill in progress: a cold prompt sent to a pod holds
    it for its uncached tokens at the uncached speed (counted speed 60k tokens/s with 4/5 of
    the prompts expected cached: 12k), and the latency model waits that long there. A page
    with a prompt counter has its backlog and no such clock."""
    pool = make_pool(3, prefill_tps=[60_000] * 3, decode_step_s=[0.01] * 3)
    sched = Scheduler(pool, max_fallbacks=0)
    for row in range(3):
        _scrape(pool, row, NOW, math.nan if row < 2 else 0.0)
    sched.state.cached_share[:3] = 0.8
    sched.state.speeds(NOW)
    cold = req(prompt=2_400)
    sched.on_dispatch(0, cold, NOW)
    sched.on_dispatch(2, cold, NOW)
    pool.table.running[[0, 2]] = 1.0  # the scrape shows it running: nothing waits
    for row in range(3):
        _scrape(pool, row, NOW + 0.01, math.nan if row < 2 else 2_400.0)
    ctx = ScoringContext(pool, sched.state, req(prompt=120), np.arange(3), NOW + 0.01)
    wait, speed = sched.state.blind_prefill(ctx.index, NOW + 0.01)
    assert speed.tolist() == pytest.approx([12_000, 12_000, 0])
    assert wait.tolist() == pytest.approx([0.19, 0.0, 0.0])  # 2,400 / 12,000 s from NOW
    ttft = predicted_ttft(ctx, 256.0)
    # blind pods: the clock, then 120 tokens at 12k; the counted pod: 120 tokens at the
    # pool's uncached speed, 60k x 0.2 (+ step)
    assert ttft.tolist() == pytest.approx([0.19 + 0.01 + 0.01, 0.01 + 0.01, 0.01 + 0.01])
    assert sched.pick(req(prompt=120), NOW + 0.01).rows[0] != 0
    sched.state.speeds(NOW + 0.3)
    assert sched.state.blind_prefill(slice(0, 3), NOW + 0.3)[0].tolist() == [0.0] * 3


def test_prefix_affinity_votes_only_within_its_ttft_ratio_of_the_best():
    pool = make_pool(2, prefill_tps=[10_000] * 2, decode_step_s=[0.01] * 2, waiting=[0, 0])
    sched = Scheduler(pool)
    blocks = list(range(1, 11))
    sched.on_dispatch(0, req(prompt=1_000, blocks=blocks), NOW)
    pool.mark_scrape(0, True, NOW)
    request = req(prompt=1_000, blocks=blocks)
    assert scores(pool, "prefix", request, sched) == [1.0, 0.0]
    assert scores(pool, "prefix", request, sched, max_ttft_ratio=4.0) == [1.0, 0.0]
    sched.state.mean_prompt = 1_000.0
    pool.table.waiting[0] = 5  # 5,000 tokens ahead: 0.51 s against 0.11 s, over 4x
    assert scores(pool, "prefix", request, sched) == [1.0, 0.0]
    assert scores(pool, "prefix", request, sched, max_ttft_ratio=4.0) == [0.0, 0.0]
    assert PROFILES["llm-d"].params["prefix"]["max_ttft_ratio"] == 4.0


def test_prefix_affinity_is_not_voted_where_every_cache_holds_the_shared_prefixes():
    pool = make_pool(2, prefill_tps=[10_000] * 2, decode_step_s=[0.01] * 2)
    sched = Scheduler(pool)
    blocks = list(range(1, 11))
    sched.on_dispatch(0, req(prompt=1_000, blocks=blocks), NOW)
    request = req(prompt=1_000, blocks=[*blocks, 99])
    ample = {"ample_cache": 0.1}
    # nothing shared yet, and no cache size known: affinity as ever
    assert scores(pool, "prefix", request, sched, **ample) == [10 / 11, 0.0]
    sched.on_dispatch(0, req(prompt=1_100, blocks=[*blocks, 98]), NOW)  # 1,000 tokens shared
    assert sched.state.footprint.tokens == 1_000
    assert scores(pool, "prefix", request, sched, **ample) == [10 / 11, 0.0]
    pool.table.kv_block_size[:2] = 16
    pool.table.kv_num_blocks[:2] = [1_000, 500]  # the smallest cache: 8,000 tokens
    sched.state.invalidate_speeds()  # read with the speeds, at most every 0.2 s
    assert scores(pool, "prefix", request, sched, **ample) == [10 / 11, 0.0]
    pool.table.kv_num_blocks[:2] = [1_000, 700]  # 11,200 tokens: 1,000 is under a tenth
    sched.state.invalidate_speeds()
    assert scores(pool, "prefix", request, sched, **ample) == [0.0, 0.0]
    assert scores(pool, "prefix", request, sched) == [10 / 11, 0.0]  # off by default
    assert PROFILES["llm-d"].params["prefix"]["ample_cache"] == 0.1


def test_prefix_affinity_yields_where_its_pod_runs_far_more_than_a_pod_of_its_size():
    """The live prefix scenario at two replicas: the hot prompt's holder ran 20-29 requests
    while a like pod ran 2-4, and affinity kept every next request of that prompt on it."""
    pool = make_pool(3, prefill_tps=[10_000] * 3, decode_step_s=[0.01] * 3)
    sched = Scheduler(pool)
    blocks = list(range(1, 11))
    for _ in range(20):
        sched.on_dispatch(0, req(prompt=1_000, blocks=blocks), NOW)
    for _ in range(2):
        sched.on_dispatch(1, req(prompt=1_000), NOW)
    sched.on_dispatch(2, req(prompt=1_000, blocks=blocks[:5]), NOW)
    request = req(prompt=1_000, blocks=[*blocks, 99])
    held = [10 / 11, 0.0, 5 / 11]
    # cache sizes unknown: an H100 beside A10Gs rightly runs more, so nothing is compared
    assert scores(pool, "prefix", request, sched, balance=2.0) == held
    pool.table.kv_block_size[:3] = 16
    pool.table.kv_num_blocks[:3] = [1_000, 1_000, 1_005]  # one GPU's pods: a few blocks apart
    sched.state.invalidate_speeds()  # read with the speeds, at most every 0.2 s
    # 20 > 2 x (1 + 4): the holder loses its vote; the pod at 1 keeps it
    assert scores(pool, "prefix", request, sched, balance=2.0) == [0.0, 0.0, 5 / 11]
    assert scores(pool, "prefix", request, sched, balance=5.0) == held  # 20 <= 5 x 5
    assert scores(pool, "prefix", request, sched) == held  # off by default
    pool.table.kv_num_blocks[2] = 2_000  # one pod of another size: sizes differ, no guard
    sched.state.invalidate_speeds()
    assert scores(pool, "prefix", request, sched, balance=2.0) == held
    assert PROFILES["llm-d"].params["prefix"]["balance"] == 2.0


def test_prefill_backlog_work_leaves_out_the_expected_cache_hits():
    pool = make_pool(1)
    sched = Scheduler(pool)
    _scrape(pool, 0, NOW, 0.0)
    for _ in range(20):  # a long shared prefix: the pod was expected to have 3/4 cached
        sched.on_dispatch(0, req(prompt=1_000), NOW, cached=0.75)
    _scrape(pool, 0, NOW + 0.05, 0.0)
    assert sched.state.prefill_backlog()[0] == 20_000.0  # whole prompts, as the counter
    work = sched.state.backlog_work(slice(0, 1))[0]
    assert 20_000.0 * 0.25 <= work < 20_000.0 * 0.26  # the EWMA converges on 1 - 0.75


def test_tie_breakers_vote_only_among_pods_near_the_best_predicted_ttft():
    # Pod 0 is 10x faster and has one more request in flight; pod 1 is idle and
    # was picked long ago. Queue, running and lru all favour pod 1 by a full point.
    pool = make_pool(2, prefill_tps=[20_000, 2_000], decode_step_s=[0.01, 0.04],
                     dispatched=[1, 0], running=[2, 0], last_picked_at=[NOW, NOW - 60])
    request = req(prompt=1_000)
    for name in ("queue", "runningRequests", "lru"):
        assert scores(pool, name, request) == [0.0, 1.0]
        assert scores(pool, name, request, latency_gated=True) == [0.0, 0.0]
    # Equal speeds: the tie-breakers keep working.
    pool.table.prefill_tps[:2] = 20_000
    pool.table.decode_step_s[:2] = 0.01
    assert scores(pool, "queue", request, latency_gated=True) == [0.0, 1.0]
    assert scores(pool, "lru", request, latency_gated=True) == [0.0, 1.0]
