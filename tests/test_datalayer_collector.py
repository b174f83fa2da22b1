"""The direct collector end to end, against local aiohttp stand-in pods."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

from contract.config import BbrConfig, GatewayConfig, MetricsConfig, SchedulerConfig
from picker.datalayer.collector import CollectorOptions, MetricsCollector, next_delay
from picker.datalayer.columns import GAUGE_STEP_S, fresh_mask, write_snapshot
from picker.datalayer.engines import Signal
from picker.datalayer.parser import MetricsSnapshot
from picker.datalayer.speed import SpeedLearner
from picker.datastore import Datastore, Pool
from simulator.standin import StandInPod
from simulator.standin_pages import LoraSeries, PodState

FAST = MetricsConfig(interval_s=0.02, timeout_s=0.3, stale_after_s=1.0)
WAIT_S = 5.0


def scheduler(name: str, endpoints: list[str], engine: str = "vllm",
              adapters: tuple[str, ...] = (), metrics: MetricsConfig = FAST) -> SchedulerConfig:
    return SchedulerConfig(name=name, model_name=f"model-{name}", engine_type=engine,
                           endpoints=tuple(endpoints), lora_adapters=adapters, metrics=metrics)


def store(*schedulers: SchedulerConfig) -> Datastore:
    return Datastore(GatewayConfig(name="t", schedulers=tuple(schedulers)))


async def wait_until(check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    """Poll `check` until true; bounded, fails the test with a clear message."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.01)


def row_of(pool: Pool, address: str) -> int:
    return pool.pods[address].row


def ok(pool: Pool, address: str) -> bool:
    pod = pool.pods.get(address)
    return pod is not None and bool(pool.table.metrics_ok[pod.row])


def failures(collector: MetricsCollector, pool: str, address: str) -> int:
    stats = collector.counters.get(pool, address)
    return 0 if stats is None else stats.failed


def fresh(pool: Pool, address: str) -> bool:
    return bool(fresh_mask(pool, time.monotonic())[row_of(pool, address)])


@pytest.fixture
async def pods() -> AsyncIterator[list[StandInPod]]:
    started: list[StandInPod] = []
    yield started
    for pod in started:
        await pod.stop()


async def start_pods(into: list[StandInPod], states: list[PodState],
                     engine: str = "vllm") -> list[str]:
    new = [StandInPod(engine, s) for s in states]
    into.extend(new)
    return [await p.start() for p in new]


@pytest.fixture
async def collectors() -> AsyncIterator[list[MetricsCollector]]:
    made: list[MetricsCollector] = []
    yield made
    for c in made:
        await c.stop()


def collector_for(made: list[MetricsCollector], datastore: Datastore,
                  **options: object) -> MetricsCollector:
    c = MetricsCollector(datastore, options=CollectorOptions(**options))  # type: ignore[arg-type]
    made.append(c)
    c.start()
    return c


async def test_values_land_in_the_right_rows(pods, collectors) -> None:
    states = [PodState(waiting=i, running=10 + i, kv_usage=i / 10, num_gpu_blocks=1000 + i)
              for i in range(3)]
    states[1].lora = [LoraSeries(("chat", "unknown"), ("sql",), 1.7e9)]
    states[1].max_lora = 3
    addresses = await start_pods(pods, states)
    ds = store(scheduler("a", addresses, adapters=("sql", "chat")))
    pool = ds.pools["a"]
    collector = collector_for(collectors, ds)
    await wait_until(lambda: all(ok(pool, a) for a in addresses))
    t = pool.table
    for i, address in enumerate(addresses):
        row = row_of(pool, address)
        assert (t.waiting[row], t.running[row], t.kv_usage[row]) == (i, 10 + i, i / 10)
        assert t.kv_num_blocks[row] == 1000 + i
        assert t.kv_block_size[row] == 16
        assert fresh(pool, address)
        stats = collector.counters.get("a", address)
        assert stats is not None and stats.ok >= 1 and stats.last_duration_s > 0
    row = row_of(pool, addresses[1])
    sql, chat = pool.adapter_index["sql"], pool.adapter_index["chat"]
    assert t.lora_running[row, chat] and not t.lora_running[row, sql]
    assert t.lora_waiting[row, sql] and not t.lora_waiting[row, chat]
    assert t.lora_running[row].sum() == 1  # "unknown" takes no slot
    assert "unknown" not in pool.adapter_index
    assert t.max_lora[row] == 3
    assert not t.lora_running[row_of(pool, addresses[0])].any()


async def test_values_follow_the_pod(pods, collectors) -> None:
    state = PodState(waiting=1)
    (address,) = await start_pods(pods, [state])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    collector_for(collectors, ds)
    await wait_until(lambda: ok(pool, address))
    state.waiting = 42
    await wait_until(lambda: pool.table.waiting[row_of(pool, address)] == 42)


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
async def test_other_engines(engine: str, pods, collectors) -> None:
    (address,) = await start_pods(pods, [PodState(waiting=5, running=6, kv_usage=0.5)], engine)
    ds = store(scheduler("a", [address], engine=engine))
    pool = ds.pools["a"]
    collector_for(collectors, ds)
    await wait_until(lambda: ok(pool, address))
    row = row_of(pool, address)
    assert (pool.table.waiting[row], pool.table.running[row]) == (5, 6)
    # SGLang's gauges are as its scheduler last set them: 40 decode steps at the most (no
    # step learned from this page, so the fallback's); Triton's page says nothing of a lag
    age = 40 * GAUGE_STEP_S if engine == "sglang" else 0.0
    assert pool.table.gauge_age_s[row] == pytest.approx(age)


async def test_trtllm_step_length_is_learned_from_the_scraped_iteration_counter(
        pods, collectors) -> None:
    """A real scrape loop over HTTP against a Triton-shaped page whose iteration counter
    runs at one step per 25 ms of wall time while requests run: the collector learns the
    step length, and an idle pod has none."""
    state = PodState(running=3.0)
    (address,) = await start_pods(pods, [state], "trtllm")
    ds = store(scheduler("a", [address], engine="trtllm"))
    pool = ds.pools["a"]
    collector_for(collectors, ds)
    started = time.monotonic()

    async def steps() -> None:
        while True:  # the counter follows the clock, so timer jitter changes no step length
            state.iterations = float(int((time.monotonic() - started) / 0.025))
            await asyncio.sleep(0.005)

    stepping = asyncio.create_task(steps())
    try:
        row = row_of(pool, address)
        await wait_until(lambda: abs(pool.table.iteration_s[row] - 0.025) < 0.008)
    finally:
        stepping.cancel()
    state.running = 0.0
    await wait_until(lambda: pool.table.iteration_s[row] == 0.0)


async def _break(pod: StandInPod, how: str) -> None:
    if how == "refused":
        await pod.stop()
    else:
        pod.mode = how  # type: ignore[assignment]


async def _repair(pod: StandInPod, how: str) -> None:
    pod.mode = "ok"
    if how == "refused":
        await pod.start()


@pytest.mark.parametrize("how", ["error", "garbage", "html", "hang", "refused"])
async def test_failing_pod_is_not_ok_then_recovers(how: str, pods, collectors) -> None:
    metrics = MetricsConfig(interval_s=0.02, timeout_s=0.2, stale_after_s=1.0)
    good, bad = await start_pods(pods, [PodState(waiting=1), PodState(waiting=2)])
    ds = store(scheduler("a", [good, bad], metrics=metrics))
    pool = ds.pools["a"]
    collector = collector_for(collectors, ds, max_backoff_s=0.2)
    await wait_until(lambda: ok(pool, good) and ok(pool, bad))
    await _break(pods[1], how)
    await wait_until(lambda: not ok(pool, bad))
    assert not fresh(pool, bad)
    assert fresh(pool, good)  # the other pod is not held up
    stats = collector.counters.get("a", bad)
    assert stats is not None and stats.failed >= 1 and stats.last_error
    assert pool.table.scrape_failures[row_of(pool, bad)] >= 1
    assert pool.table.waiting[row_of(pool, bad)] == 2  # last good numbers are kept
    pods[1].state.waiting = 9
    await _repair(pods[1], how)
    await wait_until(lambda: ok(pool, bad) and pool.table.waiting[row_of(pool, bad)] == 9)
    assert fresh(pool, bad)
    assert pool.table.scrape_failures[row_of(pool, bad)] == 0


async def test_hanging_pod_does_not_slow_the_others(pods, collectors) -> None:
    metrics = MetricsConfig(interval_s=0.02, timeout_s=0.5, stale_after_s=1.0)
    good, hung = await start_pods(pods, [PodState(), PodState()])
    pods[1].mode = "hang"
    ds = store(scheduler("a", [good, hung], metrics=metrics))
    collector = collector_for(collectors, ds)
    await asyncio.sleep(0.6)
    stats = collector.counters.get("a", good)
    assert stats is not None and stats.ok >= 10  # ~25 at 20 ms; the hung pod costs nothing


async def test_stale_after_scrapes_stop(pods, collectors) -> None:
    (address,) = await start_pods(pods, [PodState()])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    collector_for(collectors, ds)
    await wait_until(lambda: ok(pool, address))
    row = row_of(pool, address)
    now = time.monotonic()
    assert fresh_mask(pool, now)[row]
    assert not fresh_mask(pool, now + FAST.stale_after_s + 0.5)[row]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_gauge_age_bounds_when_the_engine_set_its_gauges(engine: str) -> None:
    """SGLang sets its gauges every 40 decode steps at the most: a first scrape's may be
    that old; values that changed since the last scrape were set after it; unchanged
    ones keep the last bound. vLLM's are live: age 0."""
    pool = Pool(scheduler("a", [], engine=engine))
    row = pool.add_pod("10.0.0.1:8000").row
    learner = SpeedLearner()

    def scrape(now: float, waiting: float, kv: float) -> float:
        page = MetricsSnapshot({Signal.WAITING: waiting, Signal.RUNNING: 3.0,
                                Signal.KV_USAGE: kv})
        write_snapshot(pool, row, page, learner, now)
        return float(pool.table.gauge_age_s[row])

    full = 40 * GAUGE_STEP_S if engine == "sglang" else 0.0
    assert scrape(10.0, 1.0, 0.2) == pytest.approx(full)
    assert scrape(10.3, 1.0, 0.2) == pytest.approx(full)  # unchanged: still that old
    assert scrape(10.6, 0.0, 0.25) == pytest.approx(min(full, 0.3))  # set since 10.3
    assert scrape(10.7, 0.0, 0.25) == pytest.approx(min(full, 0.4))


def test_fresh_mask_combines_every_condition() -> None:
    pool = Pool(scheduler("a", []))
    for i in range(5):
        pool.add_pod(f"10.0.0.{i}:8000")
    t = pool.table
    now = 100.0
    t.metrics_ok[:5] = True
    t.scraped_at[:5] = now - 0.5
    t.ready[1] = False
    t.metrics_ok[2] = False
    t.scraped_at[3] = now - 5.0
    pool.remove_pod("10.0.0.4:8000")
    t.metrics_ok[4] = True  # a freed row never counts, whatever it holds
    t.scraped_at[4] = now
    mask = fresh_mask(pool, now)
    assert mask.dtype == np.bool_ and mask.shape == (t.capacity,)
    assert mask.tolist()[:6] == [True, False, False, False, False, False]


async def test_pods_join_and_leave_at_run_time(pods, collectors) -> None:
    a1, a2, a3 = await start_pods(pods, [PodState(waiting=1), PodState(waiting=2),
                                         PodState(waiting=3)])
    ds = store(scheduler("a", [a1]))
    pool = ds.pools["a"]
    collector = collector_for(collectors, ds)
    await wait_until(lambda: ok(pool, a1))
    pool.add_pod(a2)
    await wait_until(lambda: ok(pool, a2))
    assert pool.table.waiting[row_of(pool, a2)] == 2
    old_row = row_of(pool, a1)
    pool.remove_pod(a1)
    await wait_until(lambda: collector.counters.get("a", a1) is None)
    pool.add_pod(a3)  # takes the freed row
    assert row_of(pool, a3) == old_row
    await wait_until(lambda: ok(pool, a3))
    await asyncio.sleep(0.1)
    assert pool.table.waiting[old_row] == 3  # never overwritten by the departed pod
    hits = pods[0].hits
    await asyncio.sleep(0.1)
    assert pods[0].hits == hits  # the departed pod is no longer scraped


async def test_scrape_of_a_departed_pod_writes_nothing(pods, collectors) -> None:
    (address,) = await start_pods(pods, [PodState(waiting=7)])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    collector = MetricsCollector(ds)
    collectors.append(collector)
    collector.start()
    pod = pool.pods[address]
    pool.remove_pod(address)
    assert await collector.scrape_once(pool, pod) is False
    assert pool.table.waiting[pod.row] == 0 and not pool.table.metrics_ok[pod.row]


async def test_pools_added_by_config_reload(pods, collectors) -> None:
    a1, a2 = await start_pods(pods, [PodState(waiting=1), PodState(waiting=2)])
    ds = store(scheduler("a", [a1]))
    collector = collector_for(collectors, ds)
    await wait_until(lambda: ok(ds.pools["a"], a1))
    ds.apply_config(GatewayConfig(name="t", bbr=BbrConfig(enabled=True), schedulers=(
        scheduler("a", [a1]), scheduler("b", [a2]))))
    await wait_until(lambda: ok(ds.pools["b"], a2))
    ds.apply_config(GatewayConfig(name="t", schedulers=(scheduler("b", [a2]),)))
    collector.refresh()  # what picker.app does after a reload: no wait for the next tick
    assert collector.counters.get("a", a1) is None


async def test_oversized_body_is_a_failed_scrape(pods, collectors) -> None:
    (address,) = await start_pods(pods, [PodState()])
    ds = store(scheduler("a", [address]))
    collector = collector_for(collectors, ds, max_body_bytes=1000)
    await wait_until(lambda: failures(collector, "a", address) > 0)
    stats = collector.counters.get("a", address)
    assert stats is not None and "1000" in stats.last_error
    assert not ok(ds.pools["a"], address)


async def test_speed_columns_learned_from_the_scrape(pods, collectors) -> None:
    state = PodState()
    state.finish(10, prompt_tokens=2000, prefill_s=0.1, queue_s=0.05, itl_s=0.02,
                 output_tokens=11)
    (address,) = await start_pods(pods, [state])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    collector_for(collectors, ds)
    await wait_until(lambda: ok(pool, address))
    row = row_of(pool, address)
    t = pool.table
    assert t.prefill_tps[row] == pytest.approx(20000.0)
    assert t.decode_step_s[row] == pytest.approx(0.02)
    assert t.ttft_s[row] == pytest.approx(0.15)
    assert t.queue_s[row] == pytest.approx(0.05)
    state.restart()
    await asyncio.sleep(0.1)
    assert t.ttft_s[row] == pytest.approx(0.15)  # a reset is not a negative rate


async def test_stop_cancels_everything_and_closes_the_session(pods) -> None:
    (address,) = await start_pods(pods, [PodState()])
    ds = store(scheduler("a", [address]))
    collector = MetricsCollector(ds)
    collector.start()
    await wait_until(lambda: ok(ds.pools["a"], address))
    session = collector.session
    await collector.stop()
    assert session is not None and session.closed
    assert collector.session is None
    hits = pods[0].hits
    await asyncio.sleep(0.1)
    assert pods[0].hits == hits


def test_next_delay_jitter_and_backoff() -> None:
    rand = random.Random(1)
    options = CollectorOptions(jitter=0.1, max_backoff_s=1.0)
    delays = [next_delay(FAST, 0, options, rand) for _ in range(200)]
    assert min(delays) >= 0.018 and max(delays) <= 0.022
    assert len(set(delays)) > 100
    still = CollectorOptions(jitter=0.0)
    assert next_delay(FAST, 3, still, rand) == pytest.approx(0.16)
    assert next_delay(FAST, 60, still, rand) == pytest.approx(0.5)  # half the 1 s stale window
    default = MetricsConfig()  # 50 ms interval, 2 s stale window
    assert next_delay(default, 60, still, rand) == pytest.approx(1.0)  # max_backoff_s
    tight = MetricsConfig(interval_s=0.05, stale_after_s=0.3)
    assert next_delay(tight, 60, still, rand) == pytest.approx(0.15)
    slow = MetricsConfig(interval_s=5.0, stale_after_s=10.0)
    assert next_delay(slow, 2, still, rand) == 5.0  # never below the interval


async def test_unexpected_error_costs_one_scrape_not_the_task(pods, collectors,
                                                             monkeypatch) -> None:
    from picker.datalayer import collector as collector_module

    (address,) = await start_pods(pods, [PodState(waiting=3)])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    real = collector_module.write_outcome
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("boom")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(collector_module, "write_outcome", flaky)
    collector = collector_for(collectors, ds, max_backoff_s=0.05)
    await wait_until(lambda: ok(pool, address))
    stats = collector.counters.get("a", address)
    assert stats is not None and stats.failed == 2 and stats.ok >= 1


async def test_switching_a_pool_to_prometheus_at_run_time(pods, collectors) -> None:
    from dataclasses import replace

    from picker.datalayer.prometheus_source import PrometheusSourceOptions

    queried: list[str] = []

    class Client:
        def custom_query(self, query: str, params: object = None,
                         timeout: object = None) -> list[dict[str, object]]:
            queried.append(query)
            return []

    (address,) = await start_pods(pods, [PodState()])
    ds = store(scheduler("a", [address]))
    pool = ds.pools["a"]
    collector = MetricsCollector(ds, options=CollectorOptions(
        prometheus=PrometheusSourceOptions(min_interval_s=0.05,
                                           client_factory=lambda url, t: Client())))
    collectors.append(collector)
    collector.start()
    await wait_until(lambda: ok(pool, address))
    pool.config = replace(pool.config, metrics=replace(
        FAST, source="prometheus", prometheus_url="http://prom:9090"))
    await wait_until(lambda: bool(queried))
    hits = pods[0].hits
    await wait_until(lambda: not ok(pool, address))  # absent from Prometheus' answer
    await asyncio.sleep(0.1)
    assert pods[0].hits == hits  # no direct scrapes any more
    pool.config = replace(pool.config, metrics=FAST)
    await wait_until(lambda: ok(pool, address))


def test_written_columns_exist_in_the_datastore() -> None:
    from picker.datalayer.columns import WRITTEN_COLUMNS
    from picker.datastore import PodTable

    table = PodTable(2)
    for column in WRITTEN_COLUMNS:
        assert hasattr(table, column), column
