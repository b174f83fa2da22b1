"""Spill-over measured: one region saturated, the measured traffic's TTFT p95 holds.

Two real Tier-1 gateways (`igw serve`, picker + Envoy) in front of simulated pods, and the
real global tier (`igw global serve`). `us-east-1` is the cheaper region, so unloaded it
takes every request; it has one pod with 4 batch slots. The same measured traffic
(open-loop streaming requests through the global router) runs three times:

1. baseline: nothing else runs; every request goes to us-east-1;
2. saturated: a closed-loop background load sent to us-east-1's Tier-1 directly keeps
   its pod full (its load summary says `saturated`), and the router spills the measured
   traffic to us-west-2: its TTFT p95 stays within +20 % of the baseline (#18's target),
   no request fails;
3. control: the same saturation, the measured traffic pinned to us-east-1 with
   `x-gateway-regions` (what a router without spill-over does): its p95 is far past the
   target, so the comparison above can fail.

Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from contract import headers as hdr
from tests.procs import gateway, gateway_config, global_config, global_router, sim_fleet
from tests.test_reliability_support import Figures, Load, LoadResult, wait_for

MODEL = "llama-3.1-8b"
SLOTS = 4
REGIONS = (("us-east-1", 0.10), ("us-west-2", 0.30))  # name, price per million tokens
RATE = 5.0  # measured requests/s
DURATION = 12.0
BACKGROUND = 6 * SLOTS  # concurrent requests kept on us-east-1 while it is saturated
TARGET = 1.20  # #18: TTFT p95 within +20 % of an unsaturated run


def _pods() -> list[dict]:
    return [{"name": name, "gpu": "h100", "model": MODEL, "max_num_seqs": SLOTS}
            for name, _ in REGIONS]


# A prompt long enough that its prefill, not the processes' CPU, makes the TTFT (~0.1 s
# at this time scale); its number first, so no two share a cached prefix.
FILLER = " ".join(f"word{j}" for j in range(1500))


def _measured(i: int) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 16, "stream": True,
                         "messages": [{"role": "user", "content": f"{i} {FILLER}"}]})


def _p95(result: LoadResult) -> float:
    ttfts = sorted(o.ttft for o in result.outcomes if o.ok)
    return ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]


@contextlib.contextmanager
def _background(url: str, ca: Path, concurrency: int) -> Iterator[Counter]:
    """`concurrency` long requests always in flight on `url` until the block ends (each
    worker sends its next one when its last ends); yields the statuses seen so far."""
    stop = threading.Event()
    statuses: Counter = Counter()
    body = orjson.dumps({"model": MODEL, "max_tokens": 600,
                         "messages": [{"role": "user", "content": "background"}]})

    async def run() -> None:
        verify = ssl.create_default_context(cafile=str(ca))
        async with httpx.AsyncClient(base_url=url, verify=verify, timeout=60) as http:
            async def worker() -> None:
                while not stop.is_set():
                    try:
                        reply = await http.post("/v1/chat/completions", content=body,
                                                headers={"content-type": "application/json"})
                        statuses[reply.status_code] += 1
                    except httpx.HTTPError as exc:
                        statuses[type(exc).__name__] += 1
                        await asyncio.sleep(0.1)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="background")
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join(timeout=90)


def _east(router) -> dict:
    regions = httpx.get(router.status_url, timeout=5).json()["regions"]
    return next(r for r in regions if r["name"] == "us-east-1")


def _measure(router, headers: dict[str, str] | None = None) -> LoadResult:
    return asyncio.run(Load(router.url, router.ca, rate=RATE, duration=DURATION,
                            body=_measured, stream=True, headers=headers, timeout=30,
                            keep_body=False).run())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spill")
    with sim_fleet(tmp, _pods(), time_scale=2.0) as fleet, contextlib.ExitStack() as stack:
        tier1 = {}
        for name, _ in REGIONS:
            pool = [{"name": "pool", "modelName": MODEL, "endpoints": [fleet.address(name)]}]
            tier1[name] = stack.enter_context(gateway(tmp, gateway_config(pool)))
        regions = [{"name": name, "endpoint": f"127.0.0.1:{tier1[name].ports['listen']}",
                    "caFile": str(tier1[name].ca), "costs": {MODEL: {"perMillionTokens": price}}}
                   for name, price in REGIONS]
        doc = global_config(
            regions, models=[{"name": MODEL, "policy": "cheapest-within-slo", "ttftSlo": "10s"}],
            polling={"interval": "100ms", "staleAfter": "1s"})
        router = stack.enter_context(global_router(tmp, doc))
        wait_for(lambda: all(r["fresh"] for r in httpx.get(
            router.status_url, timeout=5).json()["regions"]), 30, "both regions fresh")
        yield router, tier1


@pytest.mark.slow
def test_spill_over_keeps_ttft_p95_within_20_percent_of_an_unsaturated_run(world):
    router, tier1 = world
    # warm-up: both Tier-1 pickers learn their pod's speed, connections are open
    for region, _ in REGIONS:
        asyncio.run(Load(router.url, router.ca, rate=RATE, duration=3.0, body=_measured,
                         stream=True, headers={hdr.REGIONS: region}).run())
    baseline = _measure(router)
    east = tier1["us-east-1"]
    with _background(east.url, east.ca, BACKGROUND) as background:
        wait_for(lambda: _east(router)["pools"][0]["saturated"], 30,
                 "us-east-1's summary to say saturated")
        spilled = _measure(router)
        pinned = _measure(router, {hdr.REGIONS: "us-east-1"})
        east_saturated = _east(router)["pools"][0]
    fig = Figures("global router: spill-over under saturation")
    fig["measured_per_run"] = len(baseline.outcomes)
    fig["baseline_ttft_p95_ms"] = round(_p95(baseline) * 1000, 1)
    fig["spilled_ttft_p95_ms"] = round(_p95(spilled) * 1000, 1)
    fig["pinned_ttft_p95_ms"] = round(_p95(pinned) * 1000, 1)
    fig["spilled_vs_baseline"] = round(_p95(spilled) / _p95(baseline), 3)
    fig["baseline_regions"] = dict(Counter(_served(baseline)))
    fig["spilled_regions"] = dict(Counter(_served(spilled)))
    fig["background_statuses"] = dict(background)
    fig["east_while_saturated"] = {k: east_saturated[k] for k in (
        "running", "engineWaiting", "queueLength", "saturation", "saturated")}
    fig.emit()
    for result in (baseline, spilled, pinned):
        assert not result.failed(), result.summary()
        assert len(result.outcomes) >= RATE * DURATION * 0.9
    assert set(_served(baseline)) == {"us-east-1"}
    assert Counter(_served(spilled))["us-west-2"] >= 0.9 * len(spilled.outcomes)
    assert _p95(spilled) <= TARGET * _p95(baseline), fig.values
    # without spill-over the same traffic misses the target: the check above can fail
    assert _p95(pinned) > 2 * _p95(baseline), fig.values


def _served(result: LoadResult) -> list[str]:
    return [o.pod for o in result.outcomes]
