"""Flow control and the fair admission order: unit tests and a virtual-time fairness run.

- FairQueue: priority bands first, weighted fair shares between tenants within a
  band, first come first served within a tenant, bounded memory, displacement
  when full.
- Two tenants at 10:1 offered load through the queue in virtual time: the quiet
  tenant's sojourn p95 stays within +20 % of its value alone (and FIFO, the
  order admission had before, does not hold it: the test can fail).
- Flow control: committed work at the learned speed bounds what a pod is sent,
  an idle pod always has room, the bound holds before any speed is learned and
  before any scrape (the cold burst), and a burst through admission + scheduler
  in one event-loop pass dispatches only what fits.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np
import orjson
import pytest

from contract.config import SaturationConfig, SchedulerConfig, parse_config
from contract.errors import Overloaded
from picker.datalayer.columns import write_snapshot
from picker.datalayer.engines import profile_for
from picker.datalayer.parser import parse_metrics
from picker.datalayer.speed import SpeedLearner
from picker.datalayer.stats import ScrapeCounters
from picker.datastore import Datastore, Pool
from picker.director import Director, RequestInfo
from picker.gateway_metrics import GatewayMetrics
from picker.scheduling import AdmissionQueue, Scheduler, SchedulingRequest
from picker.scheduling.fair_queue import FairQueue
from picker.scheduling.flow import committed, committed_tokens, has_room, pod_room
from picker.scheduling.state import DEFAULT_PREFILL_TPS

NOW = 1_000.0
FIXTURES = Path(__file__).parent / "fixtures" / "metrics"


def make_pool(n: int = 2, delay: float = 2.0, queue_size: int = 64) -> Pool:
    endpoints = tuple(f"10.0.0.{i}:8000" for i in range(n))
    sat = SaturationConfig(queue_size=queue_size, queue_timeout_s=5.0, max_start_delay_s=delay)
    pool = Pool(SchedulerConfig(name="p", model_name="m", endpoints=endpoints, saturation=sat))
    pool.set_members(endpoints)
    for row in range(n):
        pool.mark_scrape(row, True, NOW)
    return pool


def req(prompt: int = 1000, priority: int = 0, tenant: str = "",
        weight: float = 1.0) -> SchedulingRequest:
    return SchedulingRequest("m", None, prompt, 16, np.empty(0, np.uint64), priority,
                             tenant=tenant, tenant_weight=weight)


# -- the order ------------------------------------------------------------------------------


def test_bands_first_then_fcfs_within_a_tenant():
    q: FairQueue[str] = FairQueue()
    for name, priority in (("a0", 0), ("b5", 5), ("c0", 0), ("d5", 5), ("e-1", -1), ("f10", 10)):
        q.push(name, priority)
    assert [q.pop() for _ in range(6)] == ["f10", "b5", "d5", "a0", "c0", "e-1"]
    assert len(q) == 0 and q.peek() is None


def test_equal_weights_alternate_whatever_the_backlog():
    q: FairQueue[str] = FairQueue()
    for i in range(50):
        q.push(f"a{i}", 0, "a")
    for i in range(5):
        q.push(f"b{i}", 0, "b")
    first = [q.pop() for _ in range(10)]
    assert sorted(x for x in first if x.startswith("b")) == [f"b{i}" for i in range(5)]
    assert [x for x in first if x.startswith("a")] == [f"a{i}" for i in range(5)]  # FCFS


def test_weights_set_the_shares_and_cost_is_work():
    q: FairQueue[str] = FairQueue()
    for _ in range(300):
        q.push("heavy", 0, "h", weight=3.0)
        q.push("light", 0, "l", weight=1.0)
    shares = Counter(q.pop() for _ in range(200))
    assert shares["heavy"] == pytest.approx(150, abs=2)
    q.clear()
    for _ in range(300):  # same weight: a tenant of 4x longer prompts gets 1/4 the requests
        q.push("long", 0, "long", cost=4000)
        q.push("short", 0, "short", cost=1000)
    shares = Counter(q.pop() for _ in range(100))
    assert shares["short"] == pytest.approx(80, abs=2)


def test_an_idle_tenant_banks_no_credit():
    q: FairQueue[str] = FairQueue()
    for i in range(20):
        q.push(f"a{i}", 0, "a")
    for _ in range(10):
        q.pop()  # b was idle all this time...
    for i in range(10):
        q.push(f"b{i}", 0, "b")
    nxt = [q.pop() for _ in range(6)]
    assert sum(x.startswith("b") for x in nxt) == 3  # ...so it gets its share, not a burst


def test_removed_entries_are_skipped_and_memory_follows_the_queue():
    q: FairQueue[int] = FairQueue()
    entries = [q.push(i, i % 3, f"t{i % 7}") for i in range(300)]
    for e in entries[::2]:
        q.remove(e)
        q.remove(e)  # idempotent
    assert len(q) == 150
    out = [q.pop() for _ in range(150)]
    assert sorted(out) == list(range(1, 300, 2))
    assert len(q) == 0 and q.heap_size == 0 and not q._bands


def test_cancelled_churn_keeps_the_heap_bounded():
    q: FairQueue[int] = FairQueue()
    keep = q.push(-1, 0, "x")
    for i in range(5_000):
        q.remove(q.push(i, 0, "x"))
    assert q.heap_size <= 2 * len(q) + 32 + 1
    assert len(q._bands[0].entries["x"]) <= 2 * 1 + 16 + 1
    assert q.pop() == -1 and keep.removed


def test_full_queue_displaces_the_lowest_band_then_the_furthest_past_its_share():
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(f"low{i}", -10, "a")
    for i in range(4):
        q.push(f"hog{i}", 0, "hog")
    q.push("b0", 0, "b")
    assert q.displace(5, "z") == "low2"  # a higher band takes the lowest band's newest
    assert q.displace(-10, "a") is None  # same band, same tenant: the newcomer is refused
    q.pop(), q.pop(), q.pop()  # the bands above -10 go first: hog0, b0, hog1 ...
    while q.peek().item.startswith("hog") or q.peek().item.startswith("b"):
        q.pop()
    q.clear()
    for i in range(4):
        q.push(f"hog{i}", 0, "hog")
    q.push("b0", 0, "b")
    assert q.displace(0, "b") == "hog3"  # b's next tag is below the hog's newest
    assert q.displace(0, "hog") is None  # the hog itself is refused
    assert q.displace(-5, "c") is None  # a lower band never displaces a higher one
    assert [q.pop() for _ in range(len(q))] == ["hog0", "b0", "hog1", "hog2"]


# -- fairness in virtual time ----------------------------------------------------------------


def _sojourns(fair: bool, noisy: bool, ticks: int = 400) -> list[float]:
    """The quiet tenant's time in the system (queue + its batch), in ticks.

    A pool that starts `capacity` requests per tick (one batch) behind a queue of
    `queue_size`, as admission releases them. The quiet tenant offers 20 % of
    capacity (within its half share); the noisy one ten times that (twice the
    capacity). Full queue: the fair queue displaces (as admission does), FIFO refuses.
    """
    capacity, queue_size = 10, 64
    rng = np.random.default_rng(3)
    q: FairQueue[tuple[str, int]] = FairQueue()
    fifo: deque[tuple[str, int]] = deque()
    out = []
    for tick in range(ticks):
        arrivals = [("quiet", tick)] * int(rng.poisson(2))
        if noisy:
            arrivals += [("noisy", tick)] * int(rng.poisson(20))
        order = rng.permutation(len(arrivals))
        for i in order:
            item = arrivals[i]
            if fair:
                if len(q) >= queue_size and q.displace(0, item[0]) is None:
                    continue
                q.push(item, 0, item[0])
            elif len(fifo) < queue_size:
                fifo.append(item)
        for _ in range(capacity):
            if fair and len(q):
                tenant, at = q.pop()
            elif not fair and fifo:
                tenant, at = fifo.popleft()
            else:
                break
            if tenant == "quiet":
                out.append(tick - at + 1.0)
    return out


def _p95(values: list[float]) -> float:
    return float(np.percentile(values, 95))


def test_a_tenant_at_ten_times_its_share_leaves_the_other_within_20_percent():
    alone = _p95(_sojourns(fair=True, noisy=False))
    shared = _sojourns(fair=True, noisy=True)
    assert _p95(shared) <= 1.2 * alone, (alone, _p95(shared))
    assert len(shared) >= 0.95 * len(_sojourns(fair=True, noisy=False))  # none refused
    fifo = _sojourns(fair=False, noisy=True)  # the old order: the quiet tenant drowns
    assert _p95(fifo) > 2 * alone or len(fifo) < 0.5 * len(shared)


# -- flow control ----------------------------------------------------------------------------


def test_committed_work_bounds_a_pod_and_an_idle_pod_always_has_room():
    pool = make_pool(2)
    sched = Scheduler(pool)
    pool.table.prefill_tps[:2] = [10_000.0, 1_000.0]
    sched.state.invalidate_speeds()
    rows = np.arange(2)
    assert pod_room(sched.state, req(50_000), NOW, rows).tolist() == [True, True]  # idle
    for _ in range(19):
        sched.on_dispatch(0, req(1000), NOW)
    sched.on_dispatch(1, req(1000), NOW)
    sched.on_dispatch(1, req(1000), NOW)
    assert committed_tokens(sched.state, rows).tolist() == [19_000.0, 2_000.0]
    # 2 s at 10k tokens/s: one more fits on pod 0; pod 1 (1k tokens/s) is full
    assert pod_room(sched.state, req(1000), NOW, rows).tolist() == [True, False]
    sched.on_dispatch(0, req(1000), NOW)
    assert not has_room(sched.state, req(1000), NOW)
    work = committed(sched.state, NOW)
    assert work.requests == 22 and work.prefill_tokens == 22_000
    assert work.saturation == pytest.approx(1.0)


def test_a_scrape_showing_the_prefill_done_frees_the_room():
    pool = make_pool(1)
    sched = Scheduler(pool)
    pool.table.prompt_tokens_total[0] = 0.0
    for _ in range(2):
        sched.on_dispatch(0, req(1000), NOW)
    assert not has_room(sched.state, req(1000), NOW)  # default speed: 2 s = 2,000 tokens
    pool.table.prompt_tokens_total[0] = 1000.0  # one prefill done...
    pool.mark_scrape(0, True, NOW + 0.05)  # ...as the next scrape shows
    assert committed_tokens(sched.state, np.arange(1)).tolist() == [1000.0]
    assert has_room(sched.state, req(1000), NOW + 0.05)


def test_finished_requests_lift_the_speed_of_a_pod_that_exports_none():
    """A pod with no speed signal keeps the slow default (2,000 tokens at 2 s), until the
    requests it finishes prove it faster: 1,000 prompt tokens done within 10 ms is at least
    100k tokens/s, so many more fit. A failure proves nothing."""
    pool = make_pool(1)
    sched = Scheduler(pool)
    state = sched.state
    for _ in range(2):
        sched.on_dispatch(0, req(1000), NOW)
    assert not has_room(state, req(1000), NOW)
    state.on_complete(0, req(1000), 0.01, ok=False, now=NOW + 0.01)
    assert not has_room(state, req(1000), NOW + 0.01)
    state.on_complete(0, req(1000), 0.01, ok=True, now=NOW + 0.01)
    # one sample counts for at most twice the default (2,000 tokens/s), then 1.2x each:
    # a refusal that looks fast (a huge prompt answered in 1 ms) moves it only that far
    assert state.prefill_floor[0] == pytest.approx(2_000)
    state.on_complete(0, req(1_000_000), 0.001, ok=True, now=NOW + 0.01)
    assert state.prefill_floor[0] == pytest.approx(2_400)
    for _ in range(40):
        state.on_complete(0, req(1000), 0.01, ok=True, now=NOW + 0.01)
    assert state.prefill_floor[0] == pytest.approx(100_000, rel=0.02)
    for _ in range(150):
        sched.on_dispatch(0, req(1000), NOW + 0.02)
    assert has_room(state, req(1000), NOW + 0.02)  # 100k tokens/s x 2 s: 200 requests
    work = float(committed_tokens(state, np.arange(1)).sum())
    floor = state.prefill_floor[0]
    assert committed(state, NOW + 0.02).saturation == pytest.approx(work / (2 * floor))
    # a learned speed above the floor is used as it is
    pool.table.prefill_tps[0] = 500_000.0
    state.invalidate_speeds()
    assert committed(state, NOW + 0.02).saturation == pytest.approx(work / 1_000_000)


def _committed_pod(engine: str, page: str) -> tuple[Pool, Scheduler]:
    """One pod of `engine` scraped once (the page's text), then sent 5,000 prompt tokens:
    2.5 s of work at the default speed, past the 2 s bound."""
    config = SchedulerConfig(name=engine, model_name="m", endpoints=("10.0.0.1:8000",),
                             engine_type=engine, saturation=SaturationConfig())
    pool = Pool(config)
    pool.set_members(config.endpoints)
    write_snapshot(pool, 0, parse_metrics(page, profile_for(engine)), SpeedLearner(), NOW)
    sched = Scheduler(pool)
    for _ in range(5):
        sched.on_dispatch(0, req(1000), NOW)
    return pool, sched


def test_a_page_that_measures_no_prefill_gets_no_start_bound():
    """Real pages (tests/fixtures/metrics/): Triton's TensorRT-LLM page has no series a
    prefill speed is learned from, so its pod is not held to the start delay at the slow
    default speed; vLLM's and SGLang's pods are, and so is a pod no scrape has read. It
    is the engine's property, not one page's: a cold SGLang pod, whose labelled histograms
    and counters appear only at a request's first observation, is bounded too."""
    pods = {engine: _committed_pod(engine, (FIXTURES / page).read_text())
            for engine, page in (("trtllm", "triton-trtllm-2025-04.txt"),
                                 ("vllm", "vllm-0.7-v0-aibrix-docs.txt"),
                                 ("sglang", "sglang-0.4-docs.txt"))}
    room = {e: bool(pod_room(sched.state, req(1000), NOW, np.arange(1))[0])
            for e, (_, sched) in pods.items()}
    assert room == {"trtllm": True, "vllm": False, "sglang": False}
    assert {e: bool(pool.table.prefill_unmeasured[0]) for e, (pool, _) in pods.items()} == {
        "trtllm": True, "vllm": False, "sglang": False}
    cold = "".join(line for line in (FIXTURES / "sglang-0.4-docs.txt").read_text()
                   .splitlines(keepends=True)
                   if line.startswith(("sglang:num_", "sglang:token_usage")))
    _, sched = _committed_pod("sglang", cold)
    assert not pod_room(sched.state, req(1000), NOW, np.arange(1))[0]
    # the pool's saturation counts no start delay where none is bounded
    assert committed(pods["trtllm"][1].state, NOW).saturation == 0.0
    assert committed(pods["vllm"][1].state, NOW).saturation > 1.0
    # before any scrape nothing is known of the page: bounded (the columns' default)
    pool = make_pool(1)
    sched = Scheduler(pool)
    for _ in range(5):
        sched.on_dispatch(0, req(1000), NOW)
    assert not pod_room(sched.state, req(1000), NOW, np.arange(1))[0]


def test_bound_off_and_cached_prefixes():
    pool = make_pool(1, delay=0.0)
    sched = Scheduler(pool)
    for _ in range(100):
        sched.on_dispatch(0, req(1000), NOW)
    assert has_room(sched.state, req(1000), NOW)
    assert committed(sched.state, NOW).saturation == 0.0
    pool = make_pool(1)
    sched = Scheduler(pool)
    for _ in range(8):  # 90 % of each prompt expected cached: 100 tokens of work each
        sched.on_dispatch(0, req(1000), NOW, cached=0.9)
    assert committed_tokens(sched.state, np.arange(1))[0] < 0.3 * 8000


def test_no_fresh_pod_is_still_bounded_and_no_pod_at_all_is_the_picks_503():
    pool = make_pool(2)
    sched = Scheduler(pool)
    pool.table.scraped_at[:2] = NOW - 60  # every scrape stale: degraded routing
    for row in (0, 1):
        for _ in range(2):
            sched.on_dispatch(row, req(1000), NOW)
    assert not has_room(sched.state, req(1000), NOW)
    pool.table.ready[:2] = False
    assert has_room(sched.state, req(1000), NOW)  # nothing to bound: NoReadyEndpoint decides


async def test_cold_burst_in_one_loop_pass_dispatches_only_what_fits():
    """The bypass: N requests arriving before any scrape could show them. Each
    dispatch counts at once, so the burst stops at the bound (default speed, cold)."""
    pool = make_pool(2, queue_size=1_000)
    sched = Scheduler(pool)
    queue = AdmissionQueue(pool, sched, clock=lambda: NOW)
    dispatched = Counter()

    async def one() -> None:
        r = req(1000)
        await queue.acquire(r, 0.2)
        row = sched.pick(r, NOW).rows[0]
        sched.on_dispatch(row, r, NOW)
        dispatched[row] += 1

    tasks = [asyncio.create_task(one()) for _ in range(500)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    per_pod = 2.0 * DEFAULT_PREFILL_TPS / 1000  # maxStartDelay x speed / prompt
    assert dispatched == Counter({0: per_pod, 1: per_pod})
    assert sum(isinstance(r, Exception) for r in results) == 500 - 2 * per_pod
    assert len(queue) == 0


async def test_full_queue_refuses_the_hog_not_the_newcomer():
    pool = make_pool(1, queue_size=4)
    sched = Scheduler(pool)
    queue = AdmissionQueue(pool, sched, clock=lambda: NOW)
    for _ in range(3):
        sched.on_dispatch(0, req(1000), NOW)  # the pod is full
    hog = [asyncio.create_task(queue.acquire(req(tenant="hog"), 5.0)) for _ in range(4)]
    await asyncio.sleep(0)
    quiet = asyncio.create_task(queue.acquire(req(tenant="quiet"), 5.0))
    await asyncio.sleep(0)
    assert len(queue) == 4 and not quiet.done()
    with pytest.raises(Overloaded):
        await hog[-1]
    with pytest.raises(Overloaded):
        await queue.acquire(req(tenant="hog"), 5.0)
    for t in itertools.chain(hog[:-1], [quiet]):
        t.cancel()
    await asyncio.gather(*hog[:-1], quiet, return_exceptions=True)
    assert len(queue) == 0


# -- through the director: what the handler calls, and what the metrics say ------------------


def _director(delay: str = "2s"):
    config = parse_config({
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "InferenceGatewayConfig",
        "metadata": {"name": "t"},
        "spec": {"schedulers": [{"name": "pool", "modelName": "m",
                                 "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"],
                                 "saturation": {"maxStartDelay": delay}}]},
    })
    metrics = GatewayMetrics()
    director = Director(Datastore(config), metrics)
    metrics.attach_routing(director, ScrapeCounters())
    pool = director.datastore.pools["pool"]
    for row in range(2):
        pool.mark_scrape(row, True, time.monotonic() + 60)  # fresh for the whole test
    def body(i: int) -> bytes:  # distinct from the first block: no prefix hits to discount
        text = f"{i:04d}" * 950
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})

    return director, metrics, body, RequestInfo(path="/v1/chat/completions",
                                                content_type="application/json")


def _gauge(metrics, name: str) -> float:
    for line in metrics.exposition().decode().splitlines():
        if line.startswith(f'{name}{{pool="pool"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_director_holds_what_does_not_fit_and_the_metrics_show_it():
    director, metrics, body, info = _director()
    routed = [director.route_now(body(i), info) for i in range(6)]
    held = [d for d in routed if d.admission_wait is not None]
    sent = [d for d in routed if d.admission_wait is None]
    # ~1,000-token prompts, 2 s at the default 1,000 tokens/s: two per pod, then hold
    assert len(sent) == 4 and len(held) == 2
    assert {d.address for d in sent} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert _gauge(metrics, "igw_pool_committed_requests") == 4
    assert _gauge(metrics, "igw_pool_committed_prefill_tokens") == pytest.approx(4 * 1000, rel=0.05)
    assert _gauge(metrics, "igw_pool_saturation") == pytest.approx(1.0, rel=0.05)
    assert director.admission["pool"].blocked(held[0].request, NOW)
    for d in sent:
        director.complete(d)
    assert _gauge(metrics, "igw_pool_committed_requests") == 0
    off, _, body, _ = _director("0s")
    assert all(off.route_now(body(i), info).admission_wait is None for i in range(50))


async def test_released_requests_are_dispatched_in_the_release_and_a_gone_client_ends_them():
    """The director's held requests are picked inside the queue's release: a completion
    that frees room for two dispatches both in one look. A held request whose client
    leaves after that dispatch but before it resumed is ended as a failure: its
    in-flight count goes, and its near-zero life teaches nothing about speed."""
    director, _, body, info = _director()
    routed = [director.route_now(body(i), info) for i in range(6)]
    sent = [d for d in routed if d.admission_wait is None]
    held = [d for d in routed if d.admission_wait is not None]
    assert len(sent) == 4 and len(held) == 2
    waits = [asyncio.create_task(director.admit(d)) for d in held]
    await asyncio.sleep(0)
    pool = director.datastore.pools["pool"]
    state = director.schedulers["pool"].state
    for d in sent[:2]:  # room for one more on each pod
        director.complete(d)
    director.admission["pool"]._release()
    assert all(d.dispatched for d in held)  # both in the one release
    assert not any(t.done() for t in waits)
    row = held[1].row
    learned = (float(state.spot[row]), float(state.prefill_floor[row]))
    inflight = pool.table.inflight[:2].sum()
    waits[1].cancel()  # the second client left before its task resumed
    director.abandon(held[1])
    assert pool.table.inflight[:2].sum() == inflight - 1
    assert (float(state.spot[row]), float(state.prefill_floor[row])) == learned
    await asyncio.wait_for(waits[0], 1.0)
    for d in [held[0], *sent[2:]]:
        director.complete(d)
    assert pool.table.inflight[:2].sum() == 0
