"""Instantaneous bursts at a cold and a warm pool, through the real path (issue #17).

Envoy → picker → simulator (`igw serve`, static endpoints). N concurrent chat
requests, ~800-word prompts, a third `x-gateway-criticality: sheddable`, all
opened at once on N connections, the first at a gateway that has served
nothing (what a restarted replica gets under load), then the same again at the
now warm gateway. Every request must be answered: 200, or 429/503 with an
OpenAI error body and `Retry-After`, never a client timeout or a transport
error; a served request's first token must come within the queue timeout plus
`maxStartDelay` plus its own prefill (the flow-control bound: dispatched work
starts within `maxStartDelay`); the picker's RSS stays bounded.

Before flow control the bound failed: admission judged the engines' scraped
waiting counts, which do not move while an engine admits hundreds of requests
into its batch, so a cold burst was dispatched whole (measured on `make run`'s
qwen3-32b pool: all 1,500 dispatched, 1,404 clients without an answer in 45 s).

Default suite: 300 concurrent at `make run`'s qwen3-32b pool (an H100 and an
A100: slow GPUs, where 300 undivided prompts are ~40 s of prefill).
`-m slow`: 1,500 concurrent at that pool and at two H100s of llama-3.1-8b.

    pytest tests/test_reliability_burst.py -s
    pytest tests/test_reliability_burst.py -s -m slow
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import (
    Figures,
    children,
    client_ssl,
    picker_metrics,
    rss_bytes,
)

QUEUE_TIMEOUT_S = 3.0
MAX_START_DELAY_S = 2.0  # the default, stated here because the bound is asserted
MAX_TOKENS = 24
CLIENT_TIMEOUT_S = 45.0  # the clients
WORDS = 800
SLOW_POOL = ("qwen3-32b", ("h100", "a100"))  # `make run`'s qwen3-32b pool (igw/default_fleet.yaml)
FAST_POOL = ("llama-3.1-8b", ("h100", "h100"))


@dataclass(slots=True)
class Answer:
    status: int = 0  # 0: transport error or client timeout
    error: str = ""
    # From the moment the body was sent: 1,500 simultaneous TLS handshakes on this 2-core
    # machine (client, Envoy, picker and pods share it) take seconds before that.
    first_byte_s: float = 0.0
    latency_s: float = 0.0
    connect_s: float = 0.0  # from the burst's start until the body was sent
    sent_at: float = 0.0
    retry_after: str | None = None
    content_type: str = ""
    body: bytes = b""
    complete: bool = False
    sheddable: bool = False


def _prompt(i: int) -> str:
    # distinct from the first word on: no shared prefix for the cache to discount
    return f"request {i}: " + " ".join(f"w{(i * 31 + k) % 997}" for k in range(WORDS))


async def _one(session: aiohttp.ClientSession, url: str, model: str, i: int,
               start: asyncio.Event) -> Answer:
    out = Answer(sheddable=i % 3 == 0)
    headers = {"content-type": "application/json"}
    if out.sheddable:
        headers["x-gateway-criticality"] = "sheddable"
    body = orjson.dumps({"model": model, "stream": True, "max_tokens": MAX_TOKENS,
                         "messages": [{"role": "user", "content": _prompt(i)}]})
    await start.wait()
    began = t0 = time.monotonic()
    try:
        async with session.post(url, data=body, headers=headers, trace_request_ctx=out) as resp:
            t0 = out.sent_at or t0
            out.connect_s = t0 - began
            out.status = resp.status
            out.retry_after = resp.headers.get("retry-after")
            out.content_type = resp.headers.get("content-type", "")
            chunks = []
            async for chunk in resp.content.iter_any():
                if not chunks:
                    out.first_byte_s = time.monotonic() - t0
                chunks.append(chunk)
            data = b"".join(chunks)
            out.body = data[:2048] if resp.status != 200 else b""
            out.complete = resp.status == 200 and data.rstrip().endswith(b"data: [DONE]")
    except (aiohttp.ClientError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
        out.status = 0
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.latency_s = time.monotonic() - t0
    return out


async def _body_sent(_session, ctx, _params) -> None:
    ctx.trace_request_ctx.sent_at = time.monotonic()


async def _burst(url: str, ca, model: str, n: int) -> list[Answer]:
    """`n` requests on `n` connections, released together once every task is waiting."""
    connector = aiohttp.TCPConnector(ssl=client_ssl(ca), limit=n, limit_per_host=n)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    start = asyncio.Event()
    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(_body_sent)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     trace_configs=[trace]) as session:
        tasks = [asyncio.create_task(_one(session, url + "/v1/chat/completions", model, i, start))
                 for i in range(n)]
        await asyncio.sleep(0)
        start.set()
        return await asyncio.gather(*tasks)


def _prefill_s(gpus: tuple[str, ...]) -> float:
    """One ~1,100-token prompt's prefill on the slowest pod, generously (A100 32B ≈ 0.6 s)."""
    return 1.0 if "a100" in gpus else 0.3


def _slack_s(n: int) -> float:
    """What this shared 2-core machine adds to the gateway's own answer times while `n`
    TLS handshakes and streams compete for it (client, Envoy, picker and pods alike):
    measured up to ~1 s at 300 and ~5 s at 1,500 (a sheddable request refused 4.7 s
    after its body was sent, its connection 10 s in the making)."""
    return 1.5 if n <= 300 else 6.0


def _check(fig: Figures, phase: str, answers: list[Answer], gpus: tuple[str, ...]) -> None:
    statuses = Counter(a.status for a in answers)
    served = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status != 200]
    fig[f"{phase}_statuses"] = dict(statuses)
    fig[f"{phase}_sheddable_statuses"] = dict(Counter(a.status for a in answers if a.sheddable))
    if served:
        ttft = sorted(a.first_byte_s for a in served)
        lat = sorted(a.latency_s for a in served)
        fig[f"{phase}_served_ttft_p50_s"] = ttft[len(ttft) // 2]
        fig[f"{phase}_served_ttft_max_s"] = ttft[-1]
        fig[f"{phase}_served_latency_max_s"] = lat[-1]
    if refused:
        fig[f"{phase}_refused_latency_max_s"] = max(a.latency_s for a in refused)
    fig[f"{phase}_connect_max_s"] = max(a.connect_s for a in answers)
    fig[f"{phase}_answered_after_start_max_s"] = max(a.connect_s + a.latency_s for a in answers)
    slack = _slack_s(len(answers))
    bound = QUEUE_TIMEOUT_S + MAX_START_DELAY_S + _prefill_s(gpus) + slack
    fig[f"{phase}_ttft_bound_s"] = bound

    transport = [a for a in answers if a.status == 0]
    assert not transport, f"{phase}: {len(transport)} without an answer, e.g. {transport[0].error}"
    assert set(statuses) <= {200, 429, 503}, statuses
    for a in refused:
        assert a.retry_after is not None, a
        assert a.content_type.startswith("application/json"), a
        assert b'"error"' in a.body, a
        # refused at once, or after waiting at most the queue timeout
        assert a.latency_s < QUEUE_TIMEOUT_S + slack, a
    assert {a.status for a in answers if a.sheddable and a.status != 200} <= {429}
    assert served, f"{phase}: nothing served"
    assert all(a.complete for a in served)
    late = [a.first_byte_s for a in served if a.first_byte_s > bound]
    assert not late, f"{phase}: {len(late)} first tokens past {bound:.1f}s, worst {max(late):.1f}s"


def _run(tmp, model: str, gpus: tuple[str, ...], n: int, name: str) -> None:
    pods = [{"name": f"p{i}", "gpu": g, "model": model} for i, g in enumerate(gpus)]
    with sim_fleet(tmp, pods) as fleet:
        config = gateway_config([{
            "name": "pool", "modelName": model, "endpoints": fleet.addresses(),
            "saturation": {"queueTimeout": f"{QUEUE_TIMEOUT_S:g}s"},
        }])
        with gateway(tmp, config) as gw:
            fig = Figures(name)
            picker = children(gw.proc.pid)["picker"]
            rss0 = rss_bytes(picker)
            metrics = gw.ports["metrics"]
            assert picker_metrics(metrics).get('igw_requests_total{pool="pool"}', 0.0) == 0.0
            fig["picker_rss_start_mb"] = rss0 / 2**20
            try:
                for phase in ("cold", "warm"):
                    answers = asyncio.run(_burst(gw.url, gw.ca, model, n))
                    fig[f"{phase}_picker_rss_mb"] = rss_bytes(picker) / 2**20
                    _check(fig, phase, answers, gpus)
                    time.sleep(1.0)  # let the pods' batches drain between the two bursts
            finally:
                fig.emit()
            m = picker_metrics(metrics)
            assert m['igw_admission_queue_length{pool="pool"}'] == 0.0
            assert m['igw_pool_committed_requests{pool="pool"}'] == 0.0
            assert fig.values["warm_picker_rss_mb"] < rss0 / 2**20 + 64 + n / 10


@pytest.mark.timeout(240)
def test_burst_of_300_at_a_cold_then_warm_slow_gpu_pool(tmp_path):
    _run(tmp_path, *SLOW_POOL, 300, "burst_300_qwen3_32b")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_burst_of_1500_at_a_cold_then_warm_slow_gpu_pool(tmp_path):
    _run(tmp_path, *SLOW_POOL, 1500, "burst_1500_qwen3_32b")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_burst_of_1500_at_a_cold_then_warm_two_pod_pool(tmp_path):
    _run(tmp_path, *FAST_POOL, 1500, "burst_1500_llama_8b")
