"""A simulated pod seen over HTTP: timing against its profile, caching, LoRA, preemption,
metrics consistency, every fault mode, and the real OpenAI client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.fleet import Fleet
from simulator.server import PodServer
from simulator.tokens import count_tokens

FAST = {"base_step_ms": 2.0, "per_seq_ms": 0.1, "prefill_tokens_per_s": 200_000}
SLACK_S = 0.006  # a shared 2-core machine: scheduling noise on top of the model's time


def pod_spec(**kw: Any) -> dict[str, Any]:
    return {"name": "p", "gpu": "h100", "model": "llama-3.1-8b", **kw}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def start_fleet(*pods: dict[str, Any], **top: Any) -> Fleet:
    fleet = Fleet.from_spec({"pods": list(pods), **top}, control_port=0)
    await fleet.start()
    return fleet


def chat_body(content: str, max_tokens: int | None = 4, stream: bool = True,
              model: str = "llama-3.1-8b") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": stream,
                            "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream(session: aiohttp.ClientSession, pod: PodServer,
                 body: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
    """(TTFT seconds, content chunks, usage) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft, chunks, usage = 0.0, 0, {}
    async with session.post(pod.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-sim-pod"] == pod.name
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                chunks += 1
                ttft = ttft or time.perf_counter() - t0
    return ttft, chunks, usage


async def warm_up(session: aiohttp.ClientSession, pod: PodServer) -> None:
    """Open the pooled connection first so a timed request does not pay the TCP connect."""
    async with session.get(pod.url + "/health") as r:
        await r.read()


async def best_ttft(session: aiohttp.ClientSession, pod: PodServer,
                    bodies: list[dict[str, Any]]) -> float:
    """The smallest TTFT of requests that the model gives the same TTFT, sent one by one:
    delays from other processes on a shared machine only ever add."""
    return min([(await stream(session, pod, body))[0] for body in bodies])


def lone_ttft(pod: PodServer, prompt_tokens: int, extra_s: float = 0.0) -> float:
    """The model's TTFT for a request alone on an idle pod: one iteration with batch 1."""
    p = pod.profile
    return p.step_s(1) + prompt_tokens / p.prefill_tokens_per_s + extra_s


def user_tokens(content: str) -> int:
    return count_tokens(f"<|user|>\n{content}\n<|assistant|>\n")


async def test_lone_request_ttft_matches_profile(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(), pod_spec(name="slow", gpu="l40s"))
    try:
        for name in ("p", "slow"):
            pod = fleet.pod(name)
            await warm_up(session, pod)
            contents = [f"{k}" + "z" * 4000 for k in range(3)]  # distinct: no cache hits
            _, chunks, usage = await stream(session, pod, chat_body("0" + contents[0]))
            assert chunks == 4 and usage["completion_tokens"] == 4
            assert usage["prompt_tokens"] == user_tokens("0" + contents[0])
            ttft = await best_ttft(session, pod, [chat_body(c) for c in contents])
            expected = lone_ttft(pod, user_tokens(contents[0]))
            assert expected - 0.002 <= ttft <= expected + SLACK_S, (name, ttft, expected)
        slow, fast = fleet.pod("slow").profile, fleet.pod("p").profile
        assert slow.prefill_tokens_per_s < fast.prefill_tokens_per_s
    finally:
        await fleet.stop()


async def test_time_scale_speeds_everything_up(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(), time_scale=4)
    pod = fleet.pod("p")
    try:
        await warm_up(session, pod)
        contents = [f"{k}" + "t" * 8000 for k in range(3)]
        ttft = await best_ttft(session, pod, [chat_body(c) for c in contents])
        model = lone_ttft(pod, user_tokens(contents[0]))
        assert model / 4 - 0.002 <= ttft <= model / 4 + SLACK_S
        ttft_hist = pod.engine.state()["histograms"]["ttft"]
        assert ttft_hist["sum"] / 3 == pytest.approx(model, abs=0.001)  # in model time
    finally:
        await fleet.stop()


async def test_overload_grows_queue_and_ttft(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(max_num_seqs=2, profile=FAST))
    pod = fleet.pod("p")
    try:
        tasks = [asyncio.create_task(stream(session, pod, chat_body(f"q{i}", max_tokens=20)))
                 for i in range(8)]
        peak = 0
        for _ in range(2000):  # at most ~10 s
            if all(t.done() for t in tasks):
                break
            peak = max(peak, pod.engine.state()["num_requests_waiting"])
            assert pod.engine.state()["num_requests_running"] <= 2
            await asyncio.sleep(0.005)
        ttfts = sorted(t.result()[0] for t in tasks)
        assert peak >= 4
        # Requests wait for whole earlier requests: later TTFTs are several decode runs longer.
        step = pod.profile.step_s(2)
        assert ttfts[-1] - ttfts[0] > 2 * 19 * step
    finally:
        await fleet.stop()


async def test_repeated_prefix_hits_cache_and_cuts_ttft(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(lora_adapters=["ad"]))
    pod = fleet.pod("p")
    try:
        await warm_up(session, pod)
        shared = "".join(f"{i:08d}" for i in range(1000))  # 8000 chars ≈ 2000 tokens
        cold, _, cold_usage = await stream(session, pod, chat_body(shared + " first?"))
        _, _, warm_usage = await stream(session, pod, chat_body(shared + " second?"))
        warm = await best_ttft(session, pod, [chat_body(shared + f" again {k}?") for k in range(3)])
        tokens = user_tokens(shared + " again 0?")
        cached = warm_usage["prompt_tokens_details"]["cached_tokens"]
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert cached == (len("<|user|>\n" + shared) // 64) * 16
        expected_warm = lone_ttft(pod, tokens - cached)
        assert expected_warm - 0.002 <= warm <= expected_warm + SLACK_S
        assert cold - warm > 0.8 * (cached / pod.profile.prefill_tokens_per_s)
        state = pod.engine.state()
        assert state["prefix_cache_hits"] == 4 * cached  # every request after the first
        # The chain is seeded by the served name: an adapter shares nothing with the base.
        _, _, adapter_usage = await stream(session, pod, chat_body(shared + " again 0?",
                                                                   model="ad"))
        assert adapter_usage["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        await fleet.stop()


async def test_non_resident_lora_pays_load_delay(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(lora_adapters=["a", "b"], max_loras=1))
    pod = fleet.pod("p")
    try:
        await warm_up(session, pod)
        load = pod.profile.lora_load_ms / 1000
        base = lone_ttft(pod, user_tokens("hello"))
        # One slot: alternating adapters load every time, repeating one never does.
        loading = await best_ttft(session, pod, [chat_body("hello", model=m) for m in "aba"])
        assert pod.engine.state()["lora_loads"] == 3
        resident = await best_ttft(session, pod, [chat_body("hello", model="a")] * 3)
        assert base + load - 0.002 <= loading <= base + load + SLACK_S
        assert base - 0.002 <= resident <= base + SLACK_S
        state = pod.engine.state()
        assert state["lora_loads"] == 3 and state["resident_lora_adapters"] == ["a"]
    finally:
        await fleet.stop()


async def test_kv_cache_fills_and_preempts(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(profile={**FAST, "num_gpu_blocks": 24}), time_scale=5)
    pod = fleet.pod("p")
    try:
        tasks = [asyncio.create_task(stream(session, pod, chat_body(f"{i}" * 150, max_tokens=80)))
                 for i in range(5)]
        peak_usage = 0.0
        for _ in range(5000):  # at most ~10 s
            if all(t.done() for t in tasks):
                break
            peak_usage = max(peak_usage, pod.engine.kv.usage)
            await asyncio.sleep(0.002)
        results = [t.result() for t in tasks]
        assert all(chunks == 80 for _, chunks, _ in results)  # preempted requests still finish
        state = pod.engine.state()
        assert state["num_preemptions"] > 0 and peak_usage > 0.9
        assert state["num_used_blocks"] == 0 and state["kv_cache_usage"] == 0.0
    finally:
        await fleet.stop()


def _samples(text: str) -> dict[str, Any]:
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


async def test_metrics_agree_with_engine_state(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(
        pod_spec(max_num_seqs=3, lora_adapters=["a"], max_loras=1, profile=FAST),
        pod_spec(name="s", engine="sglang", profile=FAST))
    try:
        for pod in fleet.pods.values():
            model = "a" if pod.name == "p" else "llama-3.1-8b"
            tasks = [asyncio.create_task(stream(session, pod, chat_body(
                "x" * 300 * (i % 3 + 1), max_tokens=30, model=model if i % 2 else
                "llama-3.1-8b"))) for i in range(8)]
            compared = 0
            for _ in range(200):
                if all(t.done() for t in tasks) and compared >= 5:
                    break
                compared += await _compare_once(session, pod)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert await _compare_once(session, pod) == 1  # and when idle again
            assert compared >= 5
    finally:
        await fleet.stop()


def _series(text: str, name: str) -> list[Any]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _stable(state: dict[str, Any]) -> dict[str, Any]:
    """The state minus the figures that move with the clock alone."""
    return {k: v for k, v in state.items() if k not in ("now", "gen_throughput", "lateness_ms")}


async def _compare_once(session: aiohttp.ClientSession, pod: PodServer) -> int:
    """Scrape between two state reads; compare only when no iteration ran in between."""
    async with session.get(pod.url + "/admin/state") as r:
        before = await r.json()
    async with session.get(pod.url + "/metrics") as r:
        text = await r.text()
    async with session.get(pod.url + "/admin/state") as r:
        after = await r.json()
    if _stable(before) != _stable(after):  # something happened meanwhile: try again
        return 0
    s = _samples(text)
    if pod.spec.engine == "sglang":
        gauges = after["sglang_gauges"]  # as SGLang's scheduler last set them
        assert s["sglang:num_running_reqs"].value == gauges["running"]
        assert s["sglang:num_queue_reqs"].value == gauges["waiting"]
        assert s["sglang:token_usage"].value == pytest.approx(gauges["usage"])
        assert s["sglang:generation_tokens_total"].value == after["finished_generation_tokens"]
        assert s["sglang:prompt_tokens_total"].value == after["finished_prompt_tokens"]
        return 1
    assert s["vllm:num_requests_running"].value == after["num_requests_running"]
    assert s["vllm:num_requests_waiting"].value == after["num_requests_waiting"]
    assert s["vllm:kv_cache_usage_perc"].value == pytest.approx(after["kv_cache_usage"])
    assert s["vllm:gpu_cache_usage_perc"].value == pytest.approx(after["kv_cache_usage"])
    assert s["vllm:prefix_cache_queries_total"].value == after["prefix_cache_queries"]
    assert s["vllm:prefix_cache_hits_total"].value == after["prefix_cache_hits"]
    assert s["vllm:num_preemptions_total"].value == after["num_preemptions"]
    assert s["vllm:prompt_tokens_total"].value == after["prompt_tokens"]
    assert s["vllm:generation_tokens_total"].value == after["generation_tokens"]
    assert s["vllm:time_to_first_token_seconds_count"].value == after["histograms"]["ttft"]["count"]
    assert s["vllm:e2e_request_latency_seconds_sum"].value == pytest.approx(
        after["histograms"]["e2e"]["sum"])
    lora = max(_series(text, "vllm:lora_requests_info"), key=lambda x: x.value).labels
    assert lora["running_lora_adapters"] == ",".join(after["running_lora_adapters"])
    assert lora["waiting_lora_adapters"] == ",".join(after["waiting_lora_adapters"])
    cache = s["vllm:cache_config_info"].labels
    assert int(cache["num_gpu_blocks"]) == after["num_gpu_blocks"]
    return 1


async def test_openai_client_works_against_a_pod() -> None:
    fleet = await start_fleet(pod_spec(lora_adapters=["ad"], profile=FAST))
    pod = fleet.pod("p")
    client = openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="none", max_retries=0)
    try:
        models = [m.id async for m in client.models.list()]
        assert models == ["llama-3.1-8b", "ad"]
        chat = await client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
        assert len(chat.choices[0].message.content.split()) == 6
        again = await client.chat.completions.create(
            model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=6)
        assert again.choices[0].message.content == chat.choices[0].message.content  # seeded
        parts, usage = [], None
        async for chunk in await client.chat.completions.create(
                model="ad", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            elif chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        assert len(parts) == 5 and usage is not None and usage.completion_tokens == 5
        done = await client.completions.create(model="llama-3.1-8b", prompt="abc" * 100)
        assert done.usage.completion_tokens == 128 and done.choices[0].finish_reason == "stop"
        assert done.usage.prompt_tokens == 75
        texts = [c.choices[0].text async for c in await client.completions.create(
            model="llama-3.1-8b", prompt="abc", max_tokens=3, stream=True) if c.choices]
        assert len([t for t in texts if t]) == 3
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()
        await fleet.stop()


async def test_request_errors_have_vllm_shape(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(max_queue=1, max_num_seqs=1, profile=FAST))
    pod = fleet.pod("p")
    url = pod.url + "/v1/chat/completions"
    try:
        async with session.post(url, json=chat_body("x", model="ghost")) as r:
            assert r.status == 404 and r.headers["x-sim-pod"] == "p"
            assert await r.json() == {"object": "error", "message": "The model `ghost` does not"
                                      " exist.", "type": "NotFoundError", "param": None,
                                      "code": 404}
        for raw in (b"{not json", b"[1]", orjson.dumps({"messages": "x"}),
                    orjson.dumps({"messages": [{"role": "u", "content": "x"}], "max_tokens": 0}),
                    orjson.dumps({"messages": [{"role": "u", "content": "x" * 40000}]})):
            async with session.post(url, data=raw) as r:
                body = await r.json()
                assert r.status == 400 and body["code"] == 400 and body["object"] == "error"
        # Queue bound: one running, one waiting, the third is refused with 503.
        slow = [asyncio.create_task(stream(session, pod, chat_body("y", max_tokens=200)))
                for _ in range(2)]
        await asyncio.sleep(0.05)
        async with session.post(url, json=chat_body("z")) as r:
            assert r.status == 503
        await asyncio.wait_for(asyncio.gather(*slow), 30)
    finally:
        await fleet.stop()


# ----- faults --------------------------------------------------------------------------------

async def post_faults(session: aiohttp.ClientSession, pod: PodServer,
                      faults: dict[str, Any]) -> dict[str, Any]:
    async with session.post(pod.url + "/admin/faults", json=faults) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_health_error_and_slowdown_faults(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(faults={"unhealthy": True}))
    pod = fleet.pod("p")
    url = pod.url + "/v1/chat/completions"
    try:
        async with session.get(pod.url + "/health") as r:
            assert r.status == 503  # start-up fault
        async with session.delete(pod.url + "/admin/faults") as r:
            assert (await r.json())["unhealthy"] is False
        async with session.get(pod.url + "/health") as r:
            assert r.status == 200
        await post_faults(session, pod, {"error_status": 503})
        async with session.post(url, json=chat_body("x")) as r:
            assert r.status == 503 and (await r.json())["code"] == 503
        state = await post_faults(session, pod, {"error_status": 500, "error_rate": 0.5})
        assert state["error_rate"] == 0.5
        statuses = []
        for _ in range(40):
            async with session.post(url, json=chat_body("x", max_tokens=1, stream=False)) as r:
                statuses.append(r.status)
        assert set(statuses) == {200, 500}
        await post_faults(session, pod, {"error_status": None, "slowdown": 3})
        ttft = await best_ttft(session, pod, [chat_body(f"{k}" + "a" * 4000) for k in range(3)])
        expected = 3 * lone_ttft(pod, user_tokens("0" + "a" * 4000))
        assert expected - 0.002 <= ttft <= expected + SLACK_S
        async with session.post(pod.url + "/admin/faults", json={"slowdown": 0.5}) as r:
            assert r.status == 400
    finally:
        await fleet.stop()


async def test_hang_holds_requests_until_cleared(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(profile=FAST))
    pod = fleet.pod("p")
    try:
        await post_faults(session, pod, {"hang": True})
        held = asyncio.create_task(stream(session, pod, chat_body("x")))
        health = asyncio.create_task(session.get(pod.url + "/health"))
        await asyncio.sleep(0.3)
        assert not held.done() and not health.done()
        async with session.get(pod.url + "/admin/faults") as r:
            assert (await r.json())["hang"] is True
        async with session.delete(pod.url + "/admin/faults") as r:
            assert r.status == 200
        _, chunks, _ = await asyncio.wait_for(held, 5)
        assert chunks == 4 and (await asyncio.wait_for(health, 5)).status == 200
    finally:
        await fleet.stop()


async def test_metrics_faults(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec())
    pod = fleet.pod("p")
    try:
        await post_faults(session, pod, {"metrics": "down"})
        async with session.get(pod.url + "/metrics") as r:
            assert r.status == 503
        await post_faults(session, pod, {"metrics": "garbled"})
        async with session.get(pod.url + "/metrics") as r:
            garbled = await r.text()
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(garbled))
        await post_faults(session, pod, {"metrics": "closed"})
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(pod.url + "/metrics") as r:
                await r.read()
        await post_faults(session, pod, {"metrics": "ok"})
        async with session.get(pod.url + "/metrics") as r:
            assert "vllm:num_requests_running" in await r.text()
    finally:
        await fleet.stop()


async def test_crash_refuses_connections_until_restarted(session: aiohttp.ClientSession) -> None:
    fleet = await start_fleet(pod_spec(), pod_spec(name="dead", faults={"crash": True}))
    pod, dead = fleet.pod("p"), fleet.pod("dead")
    control = fleet.control_url
    try:
        assert not dead.up  # crashed from the start: never listened
        inflight = asyncio.create_task(stream(session, pod, chat_body("x", max_tokens=100000)))
        await asyncio.sleep(0.1)
        await post_faults(session, pod, {"crash": True})
        await asyncio.sleep(0.1)
        with pytest.raises(aiohttp.ClientError):  # the stream is cut mid-way
            await inflight
        with pytest.raises(aiohttp.ClientConnectorError):
            await session.get(pod.url + "/health")
        async with session.get(f"{control}/pods") as r:
            assert {p["name"]: p["up"] for p in await r.json()} == {"p": False, "dead": False}
        async with session.delete(f"{control}/pods/p/faults") as r:
            assert (await r.json())["crash"] is True  # clearing faults does not revive it
        for name in ("p", "dead"):
            async with session.post(f"{control}/pods/{name}/restart") as r:
                assert r.status == 200 and (await r.json())["up"] is True
        for target in (pod, dead):
            _, chunks, _ = await stream(session, target, chat_body("x"))
            assert chunks == 4 and target.faults.crash is False
        assert pod.engine.state()["generation_tokens"] == 4  # a fresh engine after restart
        async with session.post(f"{control}/pods/p/faults", json={"crash": True}) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientConnectorError):
            await session.get(pod.url + "/health")
        async with session.post(f"{control}/pods/p/restart") as r:
            assert r.status == 200
        async with session.get(pod.url + "/health") as r:
            assert r.status == 200
        async with session.post(f"{control}/pods/ghost/restart") as r:
            assert r.status == 404
    finally:
        await fleet.stop()
