"""Overload and soak through the real path (`igw serve` in front of a small simulated fleet).

The fleet is deliberately small so that "capacity" is a number: 2 pods with 4
running slots each; a request generating 40 tokens takes ~0.35 s on one, so the
fleet serves ~CAPACITY requests/s at full batch. The gateway's admission
(saturation at 2 waiting per pod, a bounded queue) decides what it takes.

- burst at 5x capacity: what the gateway cannot take is answered 429/503 with
  Retry-After and an OpenAI error body, what it takes is served within its
  latency bound, memory stays bounded, and it serves normally right after;
- soak at ~80% of capacity: no errors, bounded RSS growth, no file-descriptor or
  task leak (20 s in the default suite; `-m slow` runs 3 minutes).

    pytest tests/test_reliability_overload.py -s
    pytest tests/test_reliability_overload.py -s -m slow
"""

from __future__ import annotations

import time

import pytest

from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import (
    Figures,
    Load,
    chat_body,
    children,
    open_fds,
    picker_metrics,
    rss_bytes,
    wait_for,
)

MODEL = "llama-3.1-8b"
SLOTS = 4
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL, "max_num_seqs": SLOTS} for i in range(2)]
MAX_TOKENS = 40
QUEUE_TIMEOUT_S = 2.0
QUEUE_SIZE = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    with sim_fleet(tmp, PODS, time_scale=1.0) as fleet:
        config = gateway_config(
            [
                {
                    "name": "pool",
                    "modelName": MODEL,
                    "endpoints": fleet.addresses(),
                    "saturation": {
                        "queueThreshold": 2,
                        "queueSize": QUEUE_SIZE,
                        "queueTimeout": f"{QUEUE_TIMEOUT_S:g}s",
                    },
                }
            ]
        )
        with gateway(tmp, config) as gw:
            yield fleet, gw


def _body(i: int) -> bytes:
    return chat_body(MODEL, f"question number {i}: tell me something", MAX_TOKENS)


def _capacity(gw) -> tuple[float, float]:
    """(requests/s the fleet serves at full batch, seconds one request takes), measured."""
    probe = Load(gw.url, gw.ca, rate=4, duration=1.0, body=_body).in_thread().result(60)
    assert not probe.failed()
    service = sorted(o.latency for o in probe.outcomes)[len(probe.outcomes) // 2]
    return len(PODS) * SLOTS / service, service


def _processes(gw) -> dict[str, int]:
    kids = children(gw.proc.pid)
    return {"picker": kids["picker"], "envoy": kids["envoy"]}


def test_burst_at_5x_capacity_is_shed_with_retry_after_and_recovers(stack):
    _, gw = stack
    fig = Figures("burst_5x")
    capacity, service = _capacity(gw)
    procs = _processes(gw)
    rss0 = {name: rss_bytes(pid) for name, pid in procs.items()}
    rate = 5 * capacity
    burst = Load(
        gw.url,
        gw.ca,
        rate=rate,
        duration=4.0,
        body=_body,
        # one request in four says it may be shed first
        headers=None,
        timeout=30,
    )
    sheddable = Load(
        gw.url,
        gw.ca,
        rate=rate / 4,
        duration=4.0,
        body=_body,
        headers={"x-gateway-criticality": "sheddable"},
        timeout=30,
    )
    f1, f2 = burst.in_thread(), sheddable.in_thread()
    result, shed = f1.result(90), f2.result(90)
    rss1 = {name: rss_bytes(pid) for name, pid in procs.items()}
    outcomes = result.outcomes + shed.outcomes
    served = [o for o in outcomes if o.ok]
    refused = [o for o in outcomes if not o.ok]
    fig["capacity_rps"] = capacity
    fig["service_s"] = service
    fig["offered_rps"] = rate * 1.25
    fig["requests"] = len(outcomes)
    fig["served"] = len(served)
    fig["statuses"] = dict(result.statuses(outcomes))
    fig["sheddable_statuses"] = dict(shed.statuses())
    lat = sorted(o.latency for o in served)
    fig["served_p50_s"] = lat[len(lat) // 2]
    fig["served_p99_s"] = lat[int(0.99 * (len(lat) - 1))]
    fig["refused_p99_ms"] = (
        1000 * sorted(o.latency for o in refused)[int(0.99 * (len(refused) - 1))]
    )
    for name in procs:
        fig[f"{name}_rss_growth_mb"] = (rss1[name] - rss0[name]) / 2**20
    # right after: a normal load is served normally
    after = Load(gw.url, gw.ca, rate=capacity / 2, duration=3, body=_body).in_thread().result(60)
    fig["after_statuses"] = dict(after.statuses())
    fig["after_p99_s"] = sorted(o.latency for o in after.outcomes)[-1]
    fig.emit()

    assert {o.status for o in refused} <= {429, 503}, {o.status for o in refused}
    assert not [o for o in refused if o.status == 0], "transport errors"
    for o in refused:
        assert o.retry_after is not None, o
        assert o.content_type.startswith("application/json"), o
        assert b'"error"' in o.body, o
    assert len(served) >= capacity * 4 * 0.5  # it kept serving at capacity
    # admission bound: a queue wait of at most QUEUE_TIMEOUT_S plus a pod queue of two
    assert fig.values["served_p99_s"] < QUEUE_TIMEOUT_S + 4 * service + 1.0
    assert {o.status for o in shed.outcomes if not o.ok} <= {429}
    for name in procs:
        assert fig.values[f"{name}_rss_growth_mb"] < 64
    assert not after.failed()
    assert fig.values["after_p99_s"] < 3 * service + 0.5


def _soak(gw, seconds: float, name: str) -> None:
    fig = Figures(name)
    capacity, service = _capacity(gw)
    procs = _processes(gw)
    # warm up, then take the baseline
    Load(gw.url, gw.ca, rate=0.8 * capacity, duration=3, body=_body).in_thread().result(60)
    time.sleep(1.0)
    metrics_port = gw.ports["metrics"]
    base = {n: (rss_bytes(p), open_fds(p)) for n, p in procs.items()}
    tasks0 = picker_metrics(metrics_port)["igw_picker_asyncio_tasks"]
    load = Load(
        gw.url,
        gw.ca,
        rate=0.8 * capacity,
        duration=seconds,
        body=lambda i: chat_body(MODEL, f"soak {i % 50}", MAX_TOKENS, stream=i % 3 == 0),
        stream=False,
    )
    samples = []
    future = load.in_thread()
    while not future.done():
        samples.append({n: rss_bytes(p) for n, p in procs.items()})
        time.sleep(min(5.0, seconds / 10))
    result = future.result(60)
    wait_for(
        lambda: picker_metrics(metrics_port)["igw_picker_asyncio_tasks"] <= tasks0,
        timeout=10,
        what="picker tasks back to their baseline",
    )
    end = {n: (rss_bytes(p), open_fds(p)) for n, p in procs.items()}
    fig["seconds"] = seconds
    fig["rate_rps"] = 0.8 * capacity
    fig["requests"] = len(result.outcomes)
    fig["statuses"] = dict(result.statuses())
    lat = sorted(o.latency for o in result.outcomes)
    fig["p50_s"] = lat[len(lat) // 2]
    fig["p99_s"] = lat[int(0.99 * (len(lat) - 1))]
    for n in procs:
        fig[f"{n}_rss_start_mb"] = base[n][0] / 2**20
        fig[f"{n}_rss_growth_mb"] = (end[n][0] - base[n][0]) / 2**20
        fig[f"{n}_rss_peak_growth_mb"] = (max(s[n] for s in samples) - base[n][0]) / 2**20
        fig[f"{n}_fds"] = f"{base[n][1]}->{end[n][1]}"
    fig["picker_tasks"] = (
        f"{tasks0:g}->{picker_metrics(metrics_port)['igw_picker_asyncio_tasks']:g}"
    )
    fig.emit()
    assert not result.failed(), result.failed()[:3]
    assert result.skipped == 0
    assert fig.values["p99_s"] < QUEUE_TIMEOUT_S + 4 * service
    for n in procs:
        assert end[n][1] <= base[n][1] + 4, f"{n} file descriptors grew"
        assert fig.values[f"{n}_rss_growth_mb"] < 16 + seconds / 20


def test_soak_short(stack):
    _, gw = stack
    _soak(gw, 20.0, "soak_20s")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_long(stack):
    _, gw = stack
    _soak(gw, 180.0, "soak_180s")
