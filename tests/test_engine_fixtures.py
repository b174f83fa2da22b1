"""vLLM and SGLang pages shaped like real servers' output: what a router must read from each.

Every fixture in tests/fixtures/metrics/ names its source (issue, PR, or file@commit) in its
header; expected-vllm-sglang.yaml holds the values read from it by hand. Each page is parsed
by our targeted parser and cross-checked against prometheus_client's general parser, and the
pages without signals (HELP/TYPE only, JSON, an HTML error page, nothing) must be failed
scrapes that leave the pod not ready, never a pod that looks idle.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from contract.config import GatewayConfig, MetricsConfig, SchedulerConfig
from picker.datalayer.collector import MetricsCollector
from picker.datalayer.engines import (
    INFO_SIGNALS,
    Aggregate,
    EngineProfile,
    Signal,
    aggregate_of,
    profile_for,
)
from picker.datalayer.parser import MetricsParseError, parse_metrics
from picker.datastore import Datastore
from simulator.standin import StandInPod

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
EXPECTED: dict[str, dict[str, Any]] = yaml.safe_load(
    (FIXTURES / "expected-vllm-sglang.yaml").read_text())
PAGES_WITH_SIGNALS = sorted(name for name, e in EXPECTED.items() if "values" in e)

JSON_BODY = '{"object": "error", "message": "Not Found", "code": 404}\n'
HTML_BODY = "<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\n"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def reference_values(text: str, profile: EngineProfile) -> dict[Signal, float]:
    """Signals computed from prometheus_client's parse of the whole page, by engines.py's rules."""
    best: dict[Signal, tuple[int, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            signal = profile.names.get(sample.name)
            if signal is None or signal in INFO_SIGNALS or not math.isfinite(sample.value):
                continue
            rank = profile.rank[sample.name]
            held = best.get(signal)
            if held is None or rank < held[0]:
                best[signal] = (rank, sample.value)
            elif rank == held[0]:
                total = (max(held[1], sample.value) if aggregate_of(signal) is Aggregate.MAX
                         else held[1] + sample.value)
                best[signal] = (rank, total)
    return {signal: value for signal, (_, value) in best.items()}


def test_every_fixture_file_has_expectations_and_a_source() -> None:
    names = {p.name for p in FIXTURES.glob("*.txt")
             if p.name.startswith(("vllm-", "sglang-"))}
    assert names == set(EXPECTED)
    for name in names:
        head = read(name).splitlines()[:3]
        assert head[0].startswith("# source: ") and head[1].startswith("# engine: "), name
        assert head[2].startswith("# excerpt: "), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_prometheus_client_parses_the_whole_fixture(name: str) -> None:
    list(text_string_to_metric_families(read(name)))


@pytest.mark.parametrize("name", PAGES_WITH_SIGNALS)
def test_router_values_from_real_page(name: str) -> None:
    expected = EXPECTED[name]
    profile = profile_for(expected["engine"])
    text = read(name)
    snap = parse_metrics(text, profile)
    for key, value in expected["values"].items():
        assert snap.get(Signal(key)) == pytest.approx(value), (name, key)
    for key in expected.get("absent", ()):
        assert Signal(key) not in snap.values, (name, key)
    reference = reference_values(text, profile)
    for signal, value in reference.items():
        assert snap.get(signal) == pytest.approx(value), (name, signal)
    if "lora" in expected:
        assert snap.lora is not None
        assert list(snap.lora.running) == expected["lora"]["running"]
        assert list(snap.lora.waiting) == expected["lora"]["waiting"]
        assert snap.lora.max_lora == expected["lora"]["max_lora"]


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if "fails" in e))
def test_page_without_signals_is_a_failed_scrape(name: str) -> None:
    expected = EXPECTED[name]
    with pytest.raises(MetricsParseError, match=expected["fails"]):
        parse_metrics(read(name), profile_for(expected["engine"]))


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if "lora_after" in e))
def test_newest_lora_series_wins_even_when_it_is_not_last(name: str) -> None:
    expected = EXPECTED[name]
    text = read(expected["lora_after"]) + read(name)
    lora = parse_metrics(text, profile_for(expected["engine"])).lora
    assert lora is not None
    assert (list(lora.running), list(lora.waiting), lora.max_lora) == (
        expected["lora"]["running"], expected["lora"]["waiting"], expected["lora"]["max_lora"])


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if "after" in e))
def test_excerpt_without_gauges_read_after_a_page_of_its_kind(name: str) -> None:
    """Histogram or info-gauge runs of a real page, read after a page that has the queue gauges."""
    expected = EXPECTED[name]
    profile = profile_for(expected["engine"])
    text = read(expected["after"]) + read(name)
    snap = parse_metrics(text, profile)
    for key, value in expected["after_values"].items():
        assert snap.get(Signal(key)) == pytest.approx(value), (name, key)
    for key in expected.get("absent", ()):
        assert Signal(key) not in snap.values, (name, key)
    for signal, value in reference_values(text, profile).items():
        assert snap.get(signal) == pytest.approx(value), (name, signal)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("body", [JSON_BODY, HTML_BODY, "", "\n", "# HELP x y\n# TYPE x gauge\n"],
                         ids=["json", "html", "empty", "newline", "help-type-only"])
def test_bodies_without_signals_raise(engine: str, body: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(body, profile_for(engine))


async def _ready_after_scrapes(body: bytes, engine: str) -> tuple[bool, int]:
    """Serve `body` from one stand-in pod; (metrics_ok, failed scrapes) once a few scrapes ran."""
    pod = StandInPod(engine, static_body=body)
    address = await pod.start()
    metrics = MetricsConfig(interval_s=0.02, timeout_s=0.3, stale_after_s=1.0)
    ds = Datastore(GatewayConfig(name="t", schedulers=(SchedulerConfig(
        name="a", model_name="m", engine_type=engine, endpoints=(address,), metrics=metrics),)))
    collector = MetricsCollector(ds)
    collector.start()
    try:
        deadline = time.monotonic() + 5.0
        while pod.hits < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        pool = ds.pools["a"]
        stats = collector.counters.get("a", address)
        return bool(pool.table.metrics_ok[pool.pods[address].row]), (stats.failed if stats else 0)
    finally:
        await collector.stop()
        await pod.stop()


@pytest.mark.parametrize("body", [
    read("vllm-0.5.4-v0-help-type-only.txt"), JSON_BODY, HTML_BODY, ""],
    ids=["help-type-only", "json", "html", "empty"])
async def test_collector_leaves_pod_not_ready_on_a_page_without_signals(body: str) -> None:
    ready, failed = await _ready_after_scrapes(body.encode(), "vllm")
    assert not ready
    assert failed >= 1


async def test_collector_reads_a_real_page() -> None:
    ready, failed = await _ready_after_scrapes(
        read("vllm-0.10-dp2-vllm-pr-22227.txt").encode(), "vllm")
    assert ready and failed == 0
