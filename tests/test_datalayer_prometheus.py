"""The Prometheus source: query building, answer folding, and a real Prometheus server.

The end-to-end test runs the Debian `prometheus` binary against stand-in pods
and checks that the Prometheus source fills the same columns as scraping the
pods directly. It skips (with the reason) where the binary is not installed.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from bench.procs import Child, start_child
from contract.config import BbrConfig, GatewayConfig, MetricsConfig, SchedulerConfig
from igw.ports import free_port
from picker.datalayer.collector import CollectorOptions, MetricsCollector
from picker.datalayer.engines import TRTLLM, VLLM, Signal
from picker.datalayer.prometheus_source import (
    SAMPLED_AT,
    SAMPLED_AT_END,
    PrometheusPoolSource,
    PrometheusSourceOptions,
    build_queries,
    fold_answers,
    regex_escape,
)
from picker.datalayer.speed import SpeedLearner
from picker.datalayer.stats import ScrapeCounters
from picker.datastore import Datastore, Pool
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.scheduler import Scheduler
from simulator.standin import StandInPod
from simulator.standin_pages import LoraSeries, PodState

PROMETHEUS_BIN = "/usr/bin/prometheus"
COMPARED_COLUMNS = ("waiting", "running", "kv_usage", "max_lora", "kv_block_size",
                    "kv_num_blocks", "prefill_tps", "decode_step_s", "ttft_s", "queue_s",
                    "raw_ttft_sum", "raw_ttft_count", "raw_prefill_tokens", "raw_tpot_count")


# --- pure parts -------------------------------------------------------------

def test_regex_escape_leaves_addresses_matchable() -> None:
    assert regex_escape("10.0.0.1:8000") == r"10\.0\.0\.1:8000"
    assert regex_escape("pod-a.svc:80") == r"pod-a\.svc:80"
    assert regex_escape("[::1]:8000") == r"\[::1\]:8000"


def test_build_queries_one_per_signal_plus_sample_time() -> None:
    queries = build_queries(VLLM, ["10.0.0.2:8000", "10.0.0.1:8000"], selector='job="vllm"')
    assert set(queries) == {s.value for s in VLLM.signals()} | {SAMPLED_AT, SAMPLED_AT_END}
    keys = list(queries)
    assert keys[0] == SAMPLED_AT and keys[-1] == SAMPLED_AT_END  # they bracket the rest
    kv = queries[Signal.KV_USAGE.value]
    assert kv == ("{__name__=~`vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc`,"
                  r"instance=~`10\.0\.0\.1:8000|10\.0\.0\.2:8000`,job=" + '"vllm"}')
    assert queries[SAMPLED_AT].startswith("timestamp({__name__=~`vllm:num_requests_waiting`")


def test_label_selected_series_get_a_matcher_of_their_own() -> None:
    queries = build_queries(TRTLLM, ["10.0.0.1:8002"])
    pod = r"instance=~`10\.0\.0\.1:8002`"
    assert queries[Signal.WAITING.value] == (
        "{__name__=`nv_trt_llm_request_metrics`,request_type=`waiting`," + pod + "}")
    assert queries[Signal.KV_NUM_BLOCKS.value] == (
        "{__name__=`nv_trt_llm_kv_cache_block_metrics`,kv_cache_block_type=`max`," + pod + "}")
    assert queries[SAMPLED_AT] == f"timestamp({queries[Signal.WAITING.value]})"


def test_fold_answers_picks_label_selected_series_by_their_label() -> None:
    answers = {
        "waiting": [_series("nv_trt_llm_request_metrics", "a:1", 2, request_type="waiting",
                            model="tensorrt_llm", version="1")],
        "running": [_series("nv_trt_llm_request_metrics", "a:1", 5, request_type="scheduled"),
                    _series("nv_trt_llm_request_metrics", "a:1", 99, request_type="active")],
        "kv_usage": [_series("nv_trt_llm_kv_cache_block_metrics", "a:1", 0.5,
                             kv_cache_block_type="fraction")],
    }
    snap = fold_answers(TRTLLM, answers)["a:1"].builder.build()
    assert (snap.get(Signal.WAITING), snap.get(Signal.RUNNING), snap.get(Signal.KV_USAGE)) == (
        2, 5, 0.5)


def _series(name: str, instance: str, value: float, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": name, "instance": instance, **labels},
            "value": [1700000000.0, str(value)]}


def test_fold_answers_groups_by_instance_and_resolves_like_the_parser() -> None:
    answers = {
        "waiting": [_series("vllm:num_requests_waiting", "a:1", 3),
                    _series("vllm:num_requests_waiting", "b:1", 4)],
        "running": [_series("vllm:num_requests_running", "a:1", 1),
                    _series("vllm:num_requests_running", "b:1", 2)],
        "kv_usage": [_series("vllm:gpu_cache_usage_perc", "a:1", 0.9),
                     _series("vllm:kv_cache_usage_perc", "a:1", 0.2),
                     _series("vllm:kv_cache_usage_perc", "b:1", 0.5)],
        "lora_info": [
            _series("vllm:lora_requests_info", "a:1", 5, running_lora_adapters="old",
                    waiting_lora_adapters="", max_lora="2"),
            _series("vllm:lora_requests_info", "a:1", 9, running_lora_adapters="new",
                    waiting_lora_adapters="", max_lora="2")],
        SAMPLED_AT: [{"metric": {"instance": "a:1"}, "value": [1.0, "1699999999.5"]}],
        SAMPLED_AT_END: [{"metric": {"instance": "a:1"}, "value": [1.0, "1699999999.5"]}],
        "ttft_sum": [{"metric": {"__name__": "vllm:time_to_first_token_seconds_sum"},
                      "value": [1.0, "5"]}],  # no instance label: ignored
    }
    folds = fold_answers(VLLM, answers)
    assert set(folds) == {"a:1", "b:1"}
    a = folds["a:1"].builder.build()
    assert (a.get(Signal.WAITING), a.get(Signal.KV_USAGE)) == (3, 0.2)
    assert a.lora is not None and a.lora.running == ("new",)
    assert folds["a:1"].sampled_at == 1699999999.5 and folds["a:1"].consistent
    assert folds["b:1"].builder.build().get(Signal.WAITING) == 4


class FakeClient:
    """Answers each query from a function of the query text."""

    def __init__(self, answer: Callable[[str], list[dict[str, Any]]]) -> None:
        self.answer = answer
        self.queries: list[str] = []

    def custom_query(self, query: str, params: dict[str, Any] | None = None,
                     timeout: float | None = None) -> list[dict[str, Any]]:
        self.queries.append(query)
        return self.answer(query)


def _pool(addresses: list[str], url: str = "http://prom:9090") -> Pool:
    config = SchedulerConfig(name="p", model_name="m", endpoints=tuple(addresses),
                             metrics=MetricsConfig(source="prometheus", prometheus_url=url,
                                                   stale_after_s=30.0))
    pool = Pool(config)
    pool.set_members(addresses)
    return pool


def _fake_answers(stamp: list[float]) -> Callable[[str], list[dict[str, Any]]]:
    """Pod a:1 is fully present, b:1 is missing; the sample time comes from `stamp`."""
    def answer(query: str) -> list[dict[str, Any]]:
        if query.startswith("timestamp("):
            return [{"metric": {"instance": "a:1"}, "value": [0, str(stamp[0])]}]
        for name, value in (("vllm:num_requests_waiting", 3), ("vllm:num_requests_running", 1),
                            ("vllm:kv_cache_usage_perc", 0.25)):
            if name in query:
                return [_series(name, "a:1", value)]
        return []
    return answer


async def test_source_writes_rows_marks_absent_pods_and_uses_sample_age() -> None:
    pool = _pool(["a:1", "b:1"])
    stamp = [time.time() - 3.0]
    client = FakeClient(_fake_answers(stamp))
    counters = ScrapeCounters()
    source = PrometheusPoolSource(pool, counters=counters, learner=SpeedLearner(),
                                  options=PrometheusSourceOptions(
                                      client_factory=lambda url, timeout: client))
    try:
        await source.poll_once()
        a, b = pool.pods["a:1"].row, pool.pods["b:1"].row
        t = pool.table
        assert t.metrics_ok[a] and (t.waiting[a], t.kv_usage[a]) == (3, 0.25)
        assert time.monotonic() - t.scraped_at[a] == pytest.approx(3.0, abs=0.5)
        assert not t.metrics_ok[b]
        assert counters.get("p", "b:1").failed == 1  # type: ignore[union-attr]
        assert len(client.queries) == len(VLLM.signals()) + 2
        # same sample time again: nothing new is written (and `dispatched` is kept)
        t.dispatched[a] = 5
        await source.poll_once()
        assert t.dispatched[a] == 5
        stamp[0] += 1.0
        await source.poll_once()
        assert t.dispatched[a] == 0
    finally:
        source.close()


async def test_a_scrape_landing_mid_cycle_is_not_written() -> None:
    """Old gauges with new counters must never reach the row."""
    pool = _pool(["a:1"])
    stamps = iter([100.0, 101.0, 101.0, 101.0])  # first ask, last ask, then a whole cycle
    answer = _fake_answers([0.0])

    def moving(query: str) -> list[dict[str, Any]]:
        if query.startswith("timestamp("):
            return [{"metric": {"instance": "a:1"}, "value": [0, str(next(stamps))]}]
        return answer(query)

    source = PrometheusPoolSource(pool, counters=ScrapeCounters(), learner=SpeedLearner(),
                                  options=PrometheusSourceOptions(
                                      client_factory=lambda url, timeout: FakeClient(moving)))
    row = pool.pods["a:1"].row
    try:
        await source.poll_once()
        assert not pool.table.metrics_ok[row] and pool.table.waiting[row] == 0
        await source.poll_once()
        assert pool.table.metrics_ok[row] and pool.table.waiting[row] == 3
    finally:
        source.close()


async def test_unreachable_prometheus_leaves_rows_to_go_stale() -> None:
    pool = _pool(["a:1"])

    def broken(query: str) -> list[dict[str, Any]]:
        raise ConnectionError("refused")

    counters = ScrapeCounters()
    source = PrometheusPoolSource(pool, counters=counters, learner=SpeedLearner(),
                                  options=PrometheusSourceOptions(
                                      client_factory=lambda url, timeout: FakeClient(broken)))
    row = pool.pods["a:1"].row
    pool.mark_scrape(row, True, now=time.monotonic())
    try:
        await source.poll_once()
    finally:
        source.close()
    assert pool.table.metrics_ok[row]  # untouched: it goes stale by scraped_at
    stats = counters.get("p", "a:1")
    assert stats is not None and stats.failed == 1 and "refused" in stats.last_error


async def test_real_client_against_a_dead_url_fails_fast() -> None:
    pool = _pool(["a:1"], url=f"http://127.0.0.1:{free_port()}")
    counters = ScrapeCounters()
    source = PrometheusPoolSource(pool, counters=counters, learner=SpeedLearner(),
                                  options=PrometheusSourceOptions(query_timeout_s=1.0))
    started = time.monotonic()
    try:
        await source.poll_once()
    finally:
        source.close()
    assert time.monotonic() - started < 5.0
    assert counters.get("p", "a:1").failed == 1  # type: ignore[union-attr]


# --- against a real Prometheus ----------------------------------------------

needs_prometheus = pytest.mark.skipif(
    shutil.which(PROMETHEUS_BIN) is None,
    reason=f"{PROMETHEUS_BIN} not found: install the Debian package `prometheus` "
           "(apt-get install -y prometheus) to run the Prometheus source end to end")


def _write_config(path: Path, targets: list[str]) -> None:
    quoted = ", ".join(f"'{t}'" for t in targets)
    path.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: vllm\n"
        f"    static_configs:\n      - targets: [{quoted}]\n")


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[list[str]], str]]:
    """Starts prometheus for given targets; returns its URL; stops it by PID after the test."""
    children: list[Child] = []

    def start(targets: list[str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        _write_config(config, targets)
        children.append(start_child(
            "prometheus",
            [PROMETHEUS_BIN, f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            tmp_path / "prometheus.log"))
        return f"http://127.0.0.1:{port}"

    yield start
    for child in children:
        child.stop()


async def _query(session: aiohttp.ClientSession, url: str, promql: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/api/v1/query", params={"query": promql}) as resp:
        if resp.status != 200:
            return []
        return (await resp.json())["data"]["result"]


async def _wait_targets_up(url: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            try:
                up = await _query(session, url, "up")
                if len([s for s in up if s["value"][1] == "1"]) >= n:
                    return
            except (aiohttp.ClientError, TimeoutError):
                pass  # not listening yet
            await asyncio.sleep(0.2)
    raise AssertionError(f"prometheus at {url} did not report {n} targets up in {timeout}s")


async def _wait(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _row(pool: Pool, address: str) -> int:
    return pool.pods[address].row


def _same_columns(prom: Pool, direct: Pool, address: str) -> dict[str, tuple[float, float]]:
    """Columns that differ between the two pools' rows for `address`."""
    p, d = _row(prom, address), _row(direct, address)
    diff = {}
    for column in COMPARED_COLUMNS:
        a, b = getattr(prom.table, column)[p], getattr(direct.table, column)[d]
        if not np.isclose(a, b, rtol=1e-9, atol=1e-12):
            diff[column] = (float(a), float(b))
    for column in ("lora_running", "lora_waiting"):
        if not np.array_equal(getattr(prom.table, column)[p], getattr(direct.table, column)[d]):
            diff[column] = (0.0, 1.0)
    return diff


def _same_picks(prom: Pool, direct: Pool) -> None:
    """Same columns must mean same routing: the schedulers pick the same pods, in order."""
    now = time.monotonic()
    for adapter in (None, "sql", "chat"):
        req = SchedulingRequest("m", adapter, 300, 64, np.empty(0, np.uint64))
        a = Scheduler(prom, max_fallbacks=1, rng=np.random.default_rng(7)).pick(req, now)
        b = Scheduler(direct, max_fallbacks=1, rng=np.random.default_rng(7)).pick(req, now)
        assert a.addresses == b.addresses, adapter
        assert a.scores == pytest.approx(b.scores), adapter


@pytest.fixture
async def standins() -> AsyncIterator[list[StandInPod]]:
    pods: list[StandInPod] = []
    yield pods
    for pod in pods:
        await pod.stop()


@needs_prometheus
async def test_prometheus_source_matches_direct_scraping(prometheus_factory, standins) -> None:
    states = [PodState(waiting=3, running=5, kv_usage=0.25, num_gpu_blocks=1111,
                       lora=[LoraSeries(("sql",), ("chat",), 1.7e9),
                             LoraSeries(("chat",), (), 1.8e9)]),
              PodState(waiting=0, running=1, kv_usage=0.75, max_lora=0)]
    states[0].finish(10, 1500, prefill_s=0.1, queue_s=0.02, itl_s=0.03, output_tokens=21)
    states[1].finish(3, 300, prefill_s=0.05, queue_s=0.0, itl_s=0.01, output_tokens=5)
    standins.extend(StandInPod("vllm", s) for s in states)
    addresses = [await p.start() for p in standins]
    url = prometheus_factory(addresses)
    await _wait_targets_up(url, len(addresses))

    via_prom = MetricsConfig(source="prometheus", prometheus_url=url, interval_s=0.2,
                             timeout_s=1.0, stale_after_s=5.0)
    direct = MetricsConfig(interval_s=0.05, timeout_s=0.5, stale_after_s=5.0)
    adapters = ("sql", "chat")
    ds = Datastore(GatewayConfig(name="t", bbr=BbrConfig(enabled=True), schedulers=(
        SchedulerConfig(name="prom", model_name="m1", endpoints=tuple(addresses),
                        lora_adapters=adapters, metrics=via_prom),
        SchedulerConfig(name="direct", model_name="m2", endpoints=tuple(addresses),
                        lora_adapters=adapters, metrics=direct))))
    prom, scraped = ds.pools["prom"], ds.pools["direct"]
    collector = MetricsCollector(ds, options=CollectorOptions(
        prometheus=PrometheusSourceOptions(min_interval_s=0.2, query_timeout_s=2.0)))
    collector.start()
    try:
        def all_ok() -> bool:
            return all(pool.table.metrics_ok[_row(pool, a)]
                       for pool in (prom, scraped) for a in addresses)

        await _wait(all_ok, "both pools to have good rows")
        for address in addresses:
            assert _same_columns(prom, scraped, address) == {}, address
        _same_picks(prom, scraped)
        row0 = _row(prom, addresses[0])
        assert prom.table.waiting[row0] == 3 and prom.table.lora_running[row0].sum() == 1
        assert prom.table.ttft_s[row0] == pytest.approx(0.12)
        age = time.monotonic() - prom.table.scraped_at[row0]
        assert 0.0 <= age < 3.0  # the sample's real age, not the query time

        # the pods move on: new gauges and more finished requests
        states[0].waiting, states[0].kv_usage = 8, 0.5
        states[0].finish(5, 500, prefill_s=0.5, queue_s=0.1, itl_s=0.06, output_tokens=11)
        await _wait(lambda: all(pool.table.raw_ttft_count[_row(pool, addresses[0])] == 15
                                for pool in (prom, scraped)), "both pools to see the new counters")
        await asyncio.sleep(0.3)
        for address in addresses:
            assert _same_columns(prom, scraped, address) == {}, address
        assert prom.table.waiting[row0] == 8
        _same_picks(prom, scraped)

        # a pod goes away: Prometheus marks its series stale, the source marks the row not ok
        await standins[1].stop()
        row1 = _row(prom, addresses[1])
        await _wait(lambda: not prom.table.metrics_ok[row1], "the stopped pod to drop out")
        assert prom.table.metrics_ok[row0]
    finally:
        await collector.stop()


TRITON_PAGE = Path(__file__).parent / "fixtures" / "metrics" / "triton-trtllm-2025-04.txt"


@needs_prometheus
async def test_prometheus_source_reads_triton_trtllm_like_direct_scraping(
        prometheus_factory, standins) -> None:
    """The label-matcher PromQL, run by a real Prometheus over the real Triton page."""
    standins.append(StandInPod("trtllm", static_body=TRITON_PAGE.read_bytes()))
    addresses = [await standins[0].start()]
    url = prometheus_factory(addresses)
    await _wait_targets_up(url, 1)
    ds = Datastore(GatewayConfig(name="t", schedulers=(
        SchedulerConfig(name="prom", model_name="m1", endpoints=tuple(addresses),
                        engine_type="trtllm", metrics=MetricsConfig(
                            source="prometheus", prometheus_url=url, interval_s=0.2,
                            timeout_s=1.0, stale_after_s=5.0)),
        SchedulerConfig(name="direct", model_name="m2", endpoints=tuple(addresses),
                        engine_type="trtllm", metrics=MetricsConfig(
                            interval_s=0.05, timeout_s=0.5, stale_after_s=5.0)))))
    prom, scraped = ds.pools["prom"], ds.pools["direct"]
    collector = MetricsCollector(ds, options=CollectorOptions(
        prometheus=PrometheusSourceOptions(min_interval_s=0.2, query_timeout_s=2.0)))
    collector.start()
    try:
        await _wait(lambda: all(pool.table.metrics_ok[_row(pool, addresses[0])]
                                for pool in (prom, scraped)), "both pools to have good rows")
        assert _same_columns(prom, scraped, addresses[0]) == {}
        row = _row(prom, addresses[0])
        assert (prom.table.waiting[row], prom.table.running[row],
                prom.table.kv_usage[row]) == (3, 7, 0.3125)
        assert (prom.table.kv_block_size[row], prom.table.kv_num_blocks[row]) == (32, 4000)
    finally:
        await collector.stop()


async def test_departed_pods_leave_no_counters_behind() -> None:
    pool = _pool(["a:1", "b:1"])
    counters = ScrapeCounters()
    source = PrometheusPoolSource(pool, counters=counters, learner=SpeedLearner(),
                                  options=PrometheusSourceOptions(
                                      client_factory=lambda url, timeout: FakeClient(
                                          _fake_answers([time.time()]))))
    try:
        await source.poll_once()
        assert {a for _, a, _ in counters.items()} == {"a:1", "b:1"}
        pool.remove_pod("b:1")
        await source.poll_once()
        assert {a for _, a, _ in counters.items()} == {"a:1"}
    finally:
        source.close()
