"""Simulator building blocks in isolation: profiles, tokens, KV cache, LoRA slots, faults,
spec parsing and the metrics text."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

import simulator
from simulator import metrics_text
from simulator.engine import Engine, EngineConfig, SimRequest
from simulator.faults import FaultError, FaultState
from simulator.fleet import Fleet
from simulator.kv_cache import KVCache
from simulator.lora import LoraSlots
from simulator.profiles import (
    GPUS,
    MODEL_SIZES,
    build_profile,
    choose_tensor_parallel,
    infer_model_size,
)
from simulator.spec import SpecError, load_fleet, parse_fleet, short_form
from simulator.tokens import (
    BLOCK_CHARS,
    PromptError,
    block_hashes,
    chat_prompt_text,
    completion_prompt_text,
    count_tokens,
)

# ----- profiles ----------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "size"), [
    ("llama-3.1-8b", "8b"), ("meta-llama/Llama-3.1-70B-Instruct", "70b"), ("qwen3-32b", "32b"),
    ("Qwen2.5-14B", "14b"), ("llama-3.2-1b", "1b"), ("m", "8b"), ("llama-3.1-7b", "8b"),
])
def test_model_size_is_inferred_from_the_name(name: str, size: str) -> None:
    assert infer_model_size(name) == size


def test_faster_gpus_prefill_and_decode_faster() -> None:
    order = ["h100", "a100", "l40s", "a10g"]
    profiles = [build_profile(g, "llama-3.1-8b") for g in order]
    prefill = [p.prefill_tokens_per_s for p in profiles]
    step = [p.base_step_ms for p in profiles]
    assert prefill[0] > prefill[1] and prefill[0] > prefill[3]
    assert step == sorted(step)  # H100 fastest decode, A10G slowest
    assert profiles[0].num_gpu_blocks > profiles[3].num_gpu_blocks
    # Decode cost is weights over bandwidth: H100/A10G ≈ 3.35/0.6 TB/s.
    ratio = (step[3] - 1.5) / (step[0] - 1.5)
    assert ratio == pytest.approx(3.35 / 0.6, rel=0.01)


def test_big_models_get_tensor_parallel() -> None:
    assert build_profile("h100", "llama-3.1-8b").tensor_parallel == 1
    assert build_profile("h100", "llama-3.1-70b").tensor_parallel == 4
    assert choose_tensor_parallel(GPUS["a10g"], MODEL_SIZES["70b"]) == 8  # barely fits
    assert build_profile("h100", "llama-3.1-70b", tensor_parallel=8).tensor_parallel == 8


def test_profile_overrides_and_errors() -> None:
    p = build_profile("h100", "m", overrides={"num_gpu_blocks": 10, "prefill_tokens_per_s": 5})
    assert p.num_gpu_blocks == 10 and p.prefill_tokens_per_s == 5
    assert p.max_model_len == 160  # capped to what the KV cache holds
    with pytest.raises(ValueError, match="unknown gpu"):
        build_profile("tpu", "m")
    with pytest.raises(ValueError, match="unknown profile field"):
        build_profile("h100", "m", overrides={"bogus": 1})


# ----- tokens ------------------------------------------------------------------------------

def test_prompt_text_and_token_counts() -> None:
    text = chat_prompt_text([{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert "<|system|>\nbe brief" in text and "<|user|>\nhi" in text
    assert count_tokens("abcde") == 2
    assert completion_prompt_text(["ab", "cd"]) == "abcd"
    assert count_tokens(completion_prompt_text([1, 2, 3])) == 3
    for bad in ([], None, [{"content": "x"}]):
        with pytest.raises(PromptError):
            chat_prompt_text(bad)


def test_block_hashes_are_chained_and_seeded() -> None:
    a = "a" * BLOCK_CHARS * 3
    b = "b" * BLOCK_CHARS + "a" * BLOCK_CHARS * 2
    ha, hb = block_hashes(a, "m"), block_hashes(b, "m")
    assert len(ha) == 3 and len(block_hashes(a + "x" * 63, "m")) == 3
    assert ha[1] != hb[1] and ha[2] != hb[2]  # same block text, different prefix
    assert block_hashes(a, "other")[0] != ha[0]  # seeded by model name
    assert block_hashes(a, "m") == ha


# ----- KV cache ----------------------------------------------------------------------------

def test_kv_cache_reuses_prefix_and_evicts_lru() -> None:
    kv = KVCache(8)
    hashes = [1, 2, 3]
    first = kv.allocate(hashes, 0, 4)
    assert first is not None and kv.used_blocks == 4 and kv.cached_blocks == 3
    kv.free(first)
    assert kv.used_blocks == 0 and kv.cached_blocks == 3  # freed blocks stay reusable
    assert kv.match(hashes, 10) == 3 and kv.match([1, 9, 3], 10) == 1
    second = kv.allocate(hashes, kv.match(hashes, 3), 4)
    assert second is not None and kv.used_blocks == 4
    kv.free(second)
    other = kv.allocate([7, 8, 9, 10, 11, 12], 0, 8)  # needs every block: evicts the prefix
    assert other is not None and kv.match(hashes, 3) == 0
    assert kv.allocate([1], 0, 1) is None
    kv.free(other)
    assert kv.free_blocks == 8


def test_kv_cache_grow_until_full() -> None:
    kv = KVCache(3)
    alloc = kv.allocate([], 0, 1)
    assert alloc is not None
    assert kv.grow(alloc) and kv.grow(alloc) and not kv.grow(alloc)
    assert kv.usage == 1.0


# ----- LoRA ----------------------------------------------------------------------------------

def test_lora_slots_load_reuse_and_evict_idle_lru() -> None:
    slots = LoraSlots(2)
    assert slots.acquire("a") is True and slots.acquire("a") is False
    assert slots.acquire("b") is True
    assert not slots.can_acquire("c") and slots.acquire("c") is None  # both pinned
    slots.release("a")
    slots.release("a")
    assert slots.acquire("c") is True and slots.resident == ["b", "c"]
    assert slots.loads == 3


# ----- faults and spec -----------------------------------------------------------------------

def test_fault_updates_validate_and_merge() -> None:
    f = FaultState()
    f.update({"error_status": 503})
    assert f.error_rate == 1.0 and f.failure_status(random.Random(0)) == 503
    f.update({"error_rate": 0.0, "slowdown": 2})
    assert f.failure_status(random.Random(0)) is None and f.error_status == 503
    for bad in ({"slowdown": 0.5}, {"error_status": 404}, {"metrics": "x"}, {"nope": 1},
                {"hang": 1}, [1]):
        with pytest.raises(FaultError):
            f.update(bad)
    assert f.slowdown == 2.0  # failed updates change nothing


def test_fleet_spec_validation_names_the_field() -> None:
    spec = parse_fleet(short_form(["h100", "a10g"], "llama-3.1-8b", 9000, loras=["x"]))
    assert [p.port for p in spec.pods] == [9000, 9001] and spec.pods[1].lora_adapters == ("x",)
    cases = [
        ({"pods": [{"gpu": "h100"}]}, r"pods\[0\]\.model"),
        ({"pods": [{"gpu": "h100", "model": "m", "colour": 1}]}, "colour"),
        ({"pods": [{"gpu": "h900", "model": "m"}]}, "unknown gpu"),
        ({"pods": [{"gpu": "h100", "model": "m", "faults": {"hang": "yes"}}]}, "hang"),
        ({"pods": [{"gpu": "h100", "model": "m"}], "time_scale": 0.5}, "time_scale"),
        ({"pods": [{"gpu": "h100", "model": "m", "name": "a"},
                   {"gpu": "h100", "model": "m", "name": "a"}]}, "unique"),
        ({"pods": []}, "pods"),
    ]
    for data, match in cases:
        with pytest.raises(SpecError, match=match):
            parse_fleet(data)


# ----- engine + metrics text (no HTTP) ------------------------------------------------------

async def test_metrics_text_parses_and_matches_engine_state() -> None:
    profile = build_profile("h100", "m", overrides={"base_step_ms": 1, "num_gpu_blocks": 64})
    engine = Engine(EngineConfig(model='m"x', profile=profile, max_loras=2, time_scale=10))
    engine.start()
    try:
        reqs = [SimRequest(model="m", adapter="a" if i % 2 else None, prompt_tokens=40,
                           hashes=[], max_tokens=5, stream=False) for i in range(4)]
        for r in reqs:
            engine.submit(r)
        await asyncio.sleep(0.001)
        for kind, prefix in (("vllm", "vllm:"), ("sglang", "sglang:")):
            families = {f.name: f for f in text_string_to_metric_families(
                metrics_text.render(engine, kind).decode())}
            assert all(name.startswith(prefix) for name in families)
        for r in reqs:
            while not r.finished:
                await r.progress()
        state = engine.state()
        text = metrics_text.render(engine, "vllm").decode()
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["vllm:generation_tokens_total"].value == state["generation_tokens"] == 20
        assert samples["vllm:request_success_total"].labels["model_name"] == 'm"x'
        assert samples["vllm:time_to_first_token_seconds_count"].value == 4
        assert samples["vllm:cache_config_info"].labels["num_gpu_blocks"] == "64"
        lora = samples["vllm:lora_requests_info"].labels
        assert lora["max_lora"] == "2" and lora["running_lora_adapters"] == ""
        assert state["resident_lora_adapters"] == ["a"]
    finally:
        await engine.stop()


def test_example_fleet_file_is_valid() -> None:
    spec = load_fleet(Path(simulator.__file__).parent / "fleet-example.yaml")
    assert [p.gpu for p in spec.pods] == ["h100", "h100", "a100", "a10g", "l40s"]
    assert spec.pods[4].engine == "sglang" and spec.seed == 7


@pytest.mark.parametrize("body", [
    {"model": "llama-3.1-8b", "messages": [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": [{"type": "text", "text": "héllo wörld " * 30},
                                     {"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"model": "sql-lora", "prompt": "SELECT * FROM t; " * 40},
    {"model": "m", "prompt": list(range(100))},
])
def test_prompt_and_hashes_match_the_gateway(body: dict[str, object]) -> None:
    """The contract of docs/bbr.md: the pod's prompt text, token count and block hashes are
    the gateway's, so prefix affinity routes to the blocks a pod really holds."""
    bbr = pytest.importorskip("bbr")
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = bbr.parse_request(orjson.dumps(body), path, "application/json", None, 1 << 20)
    text = chat_prompt_text(body["messages"]) if chat else completion_prompt_text(body["prompt"])
    assert text == req.prompt and count_tokens(text) == req.prompt_tokens
    model = str(body["model"])
    assert block_hashes(text, model) == bbr.prefix_hashes(model, text).tolist()


def _req(tokens: int, out: int, adapter: str | None = None) -> SimRequest:
    return SimRequest(model=adapter or "m", adapter=adapter, prompt_tokens=tokens, hashes=[],
                      max_tokens=out, stream=True)


def _step(engine: Engine) -> None:
    """One scheduler iteration without the clock (the loop task is never started)."""
    start = engine._last_end
    engine.end_iteration(start, start + engine.begin_iteration(start))


async def test_scheduler_skips_blocked_adapter_but_keeps_fcfs() -> None:
    profile = build_profile("h100", "m", overrides={"num_gpu_blocks": 1000})
    engine = Engine(EngineConfig(model="m", profile=profile, max_loras=1, max_num_seqs=8))
    a1, b, plain, a2 = _req(20, 5, "a"), _req(20, 5, "b"), _req(20, 5), _req(20, 5, "a")
    for r in (a1, b, plain, a2):
        engine.submit(r)
    _step(engine)
    # "b" cannot load while "a" is pinned: skipped, but it keeps its place at the head.
    assert engine.running == [a1, plain, a2] and list(engine.waiting) == [b]
    while not a2.finished:
        _step(engine)
    _step(engine)
    assert engine.running == [b] and engine.lora.resident == ["b"] and engine.lora.loads == 2


async def test_scheduler_preempts_newest_and_recomputes() -> None:
    profile = build_profile("h100", "m", overrides={"num_gpu_blocks": 6})
    engine = Engine(EngineConfig(model="m", profile=profile, max_num_seqs=8))
    old, new = _req(32, 40), _req(32, 40)  # 2 blocks each to start, 5 blocks at the end
    engine.submit(old)
    engine.submit(new)
    for _ in range(60):
        _step(engine)
        if engine.stats.preemptions:
            break
    assert engine.stats.preemptions == 1 and engine.running == [old]
    assert list(engine.waiting) == [new] and new.alloc is None and new.generated > 0
    for _ in range(200):
        if old.finished and new.finished:
            break
        _step(engine)
    assert old.generated == new.generated == 40 and engine.kv.used_blocks == 0


async def test_prefill_budget_spreads_admissions() -> None:
    profile = build_profile("h100", "m")
    engine = Engine(EngineConfig(model="m", profile=profile, max_num_batched_tokens=1000))
    reqs = [_req(400, 3) for _ in range(4)]
    for r in reqs:
        engine.submit(r)
    _step(engine)
    assert engine.running == reqs[:2]  # 800 tokens; a third would pass the 1000 budget
    _step(engine)
    assert engine.running == reqs


def _page(engine: Engine, kind: str, now: float | None = None) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(
        metrics_text.render(engine, kind, now=now).decode()) for s in f.samples}


def _sglang_load(engine: Engine, now: float | None = None) -> tuple[float, float]:
    samples = _page(engine, "sglang", now)
    return samples["sglang:num_running_reqs"], samples["sglang:num_queue_reqs"]


async def test_sglang_gauges_are_set_at_prefill_batches_every_40_decode_steps_and_idle() -> None:
    """As SGLang's scheduler sets them (simulator/engine.py, SGLANG_DECODE_LOG_INTERVAL): a
    request in its prefill is in neither gauge, and between settings a scrape reads old
    values, unlike vLLM's page, which counts it as running at once."""
    profile = build_profile("h100", "m", overrides={"num_gpu_blocks": 1000})
    engine = Engine(EngineConfig(model="m", profile=profile, max_num_seqs=2))
    reqs = [_req(20, 100) for _ in range(3)]
    for r in reqs:
        engine.submit(r)
    _step(engine)  # a prefill batch of two: set before it ran, with none yet decoding
    assert _sglang_load(engine) == (0, 1)
    assert _page(engine, "vllm")["vllm:num_requests_running"] == 2
    for _ in range(39):
        _step(engine)
    assert _sglang_load(engine) == (0, 1)  # 39 decode steps: not set again
    _step(engine)
    assert _sglang_load(engine) == (2, 1)
    while not reqs[2].finished:
        _step(engine)
    idle_at = engine._last_end
    stale = _sglang_load(engine, now=idle_at + 29.0)
    assert stale != (0, 0)  # idle, but the last setting is younger than 30 s
    assert _sglang_load(engine, now=idle_at + 31.0) == (0, 0)


async def test_fleet_from_file_binds_free_ports(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("pods:\n  - {gpu: l4, model: qwen2.5-3b}\n  - {gpu: h200, model: m}\n")
    async with Fleet.from_file(path) as fleet:
        ports = [p.port for p in fleet.pods.values()]
        assert all(ports) and len(set(ports)) == 2 and fleet.control_url is None
        assert fleet.pod("pod-0").profile.model_size == "3b"
    assert not any(p.up for p in fleet.pods.values())
