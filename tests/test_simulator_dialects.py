"""The simulator's pages against the real ones in tests/fixtures/metrics/.

Each real page that a simulated pod can imitate is compared with the simulator's page for
the same dialect: every family of the real page that the gateway reads (its engine profile in
picker/datalayer/engines.py) must be on the simulated page, and every family both pages have
must have the same type and the same label names, and for Triton the same fixed label values
(`request_type`, `kv_cache_block_type`, ...). Fixtures are found by name, so a page that
lands later is compared without a change here; fixtures of dialects the simulator does not
speak (trtllm-serve, Triton's own nv_inference_* page) are listed in NOT_SPOKEN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession
from prometheus_client.parser import text_string_to_metric_families

from picker.datalayer.engines import Signal, profile_for
from picker.datalayer.parser import parse_metrics
from simulator import metrics_text
from simulator.engine import Engine
from simulator.fleet import Fleet
from simulator.server import build_request, sglang_load
from simulator.spec import SpecError, parse_fleet

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
MODEL = "llama-3.1-8b"
# fixture name prefix -> the pod fields that make the simulator speak that page's dialect
DIALECTS: dict[str, dict[str, Any]] = {
    "vllm-0.10-dp2-": {"engine": "vllm", "data_parallel": 2},
    "vllm-0.10.0-": {"engine": "vllm"},
    "vllm-0.11.0-": {"engine": "vllm"},
    "vllm-0.8-": {"engine": "vllm", "metrics_version": "vllm-0.8"},
    "vllm-0.7-": {"engine": "vllm", "metrics_version": "vllm-0.8"},
    "vllm-lora-": {"engine": "vllm"},
    "sglang-0.4-": {"engine": "sglang", "metrics_version": "sglang-0.4"},
    "sglang-0.5": {"engine": "sglang"},
    "triton-trtllm-2025-04": {"engine": "trtllm"},
    "triton-trtllm-2025-02": {"engine": "trtllm", "metrics_version": "triton-trtllm-2025-02"},
}
# vllm-0.6-...-pr-11117: an unmerged branch's per-adapter `model_name` series, never released
NOT_SPOKEN = ("trtllm-serve-", "triton-trtllm-issue49-", "triton-20.03-", "vllm-0.5.4-",
              "vllm-0.6-v0-lora-model-name-pr-11117")
# labels whose values are fixed names on the real page (not numbers or model names)
FIXED_LABELS = {"request_type", "kv_cache_block_type", "memory_type", "general_type",
                "inflight_batcher_specific_metric", "disaggregated_serving_type"}


def _pages() -> list[Path]:
    return sorted(p for p in FIXTURES.glob("*.txt") if _dialect(p) is not None)


def _dialect(path: Path) -> dict[str, Any] | None:
    for prefix, fields in DIALECTS.items():
        if path.name.startswith(prefix):
            return fields
    return None


def _busy_engine(fields: dict[str, Any]) -> tuple[Engine, metrics_text.PageOptions]:
    """A pod's engine after a few iterations in virtual time: requests running, waiting,
    finished, every histogram observed."""
    pod = parse_fleet({"pods": [{"gpu": "a10g", "model": MODEL, "max_num_seqs": 4,
                                 "lora_adapters": ["sql"], **fields}]}).pods[0]
    engine = Engine(pod.engine_config(pod.build_profile()))
    for i in range(9):
        req, _ = build_request({"model": "sql" if i == 3 else MODEL, "max_tokens": 3 + i,
                                "messages": [{"role": "user", "content": f"q{i} " * 60}]},
                               req_model := "sql" if i == 3 else MODEL, MODEL, True)
        assert req.model == req_model
        engine.submit(req, at=0.0)
    now = 0.0
    for _ in range(6):
        step = engine.begin_iteration(now)
        engine.end_iteration(now, now + step)
        now += step
    assert engine.running and engine.waiting and engine.stats.e2e.count
    return engine, pod.page_options()


def _render(fields: dict[str, Any]) -> tuple[str, Engine]:
    engine, options = _busy_engine(fields)
    engine.current_gen_throughput = lambda: 12.5  # type: ignore[method-assign]  # no loop here
    return metrics_text.render(engine, fields["engine"], options, 1.7e9).decode(), engine


def _families(text: str) -> dict[str, tuple[str, list[dict[str, str]]]]:
    """sample name -> (family type, label sets of its samples), as prometheus_client reads
    the page; `le` is left out (the buckets' bound)."""
    out: dict[str, tuple[str, list[dict[str, str]]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            out.setdefault(sample.name, (family.type, []))[1].append(labels)
    return out


def _read_names(engine: str) -> set[str]:
    """The series names the gateway reads for `engine`, without any {label="value"} key."""
    return {name.split("{")[0] for name in profile_for(engine).names}


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.name)
def test_simulated_page_matches_the_real_one(path: Path) -> None:
    fields = _dialect(path)
    assert fields is not None
    real = _families(path.read_text())
    simulated_text, _ = _render(fields)
    simulated = _families(simulated_text)
    read = _read_names(fields["engine"])
    compared = 0
    for name, (kind, label_sets) in real.items():
        if name.split("_bucket")[0] in read or name in read:
            assert name in simulated, f"{name}: read by the gateway, on the real page, not ours"
        if name not in simulated:
            continue
        compared += 1
        sim_kind, sim_sets = simulated[name]
        if kind != "unknown":  # a grep of sample lines has no TYPE line
            assert sim_kind == kind, f"{name}: type {sim_kind}, real page {kind}"
        assert {frozenset(s) for s in sim_sets} == {frozenset(s) for s in label_sets}, name
        for label in FIXED_LABELS & {k for s in label_sets for k in s}:
            real_values = {s[label] for s in label_sets}
            assert {s[label] for s in sim_sets} == real_values, f"{name}{{{label}}}"
    assert compared >= min(3, len(real)), f"{path.name}: too few families in common"


def test_every_fixture_is_compared_or_named_as_not_spoken() -> None:
    for path in FIXTURES.glob("*.txt"):
        assert _dialect(path) is not None or path.name.startswith(NOT_SPOKEN), path.name


@pytest.mark.parametrize("fields", [
    {"engine": "vllm"}, {"engine": "vllm", "data_parallel": 3},
    {"engine": "vllm", "metrics_version": "vllm-0.8"}, {"engine": "sglang"},
    {"engine": "sglang", "metrics_version": "sglang-0.4"}, {"engine": "trtllm"},
], ids=lambda f: "-".join(str(v) for v in f.values()))
def test_gateway_parser_reads_the_pods_numbers(fields: dict[str, Any]) -> None:
    text, engine = _render(fields)
    snap = parse_metrics(text, profile_for(fields["engine"]))
    # SGLang's gauges are as its scheduler last set them (test_simulator_units)
    load = engine.published if fields["engine"] == "sglang" else None
    assert snap.get(Signal.WAITING) == (load.waiting if load else len(engine.waiting))
    assert snap.get(Signal.RUNNING) == (load.running if load else len(engine.running))
    assert snap.get(Signal.KV_USAGE) == pytest.approx(load.usage if load else engine.kv.usage)
    if fields["engine"] == "trtllm":
        assert snap.get(Signal.KV_NUM_BLOCKS) == engine.kv.num_blocks
        assert snap.get(Signal.KV_BLOCK_SIZE) == engine.profile.block_size
        return
    stats = engine.stats
    assert snap.get(Signal.TTFT_COUNT) == stats.ttft.count
    assert snap.get(Signal.TTFT_SUM) == pytest.approx(stats.ttft.sum)
    assert snap.get(Signal.TPOT_COUNT) == stats.itl.count
    if fields["engine"] == "sglang":  # counted as requests finish: running ones not yet
        assert stats.finished_prompt_tokens < stats.prompt_tokens
        assert Signal.PROMPT_TOKENS not in snap.values
        assert snap.get(Signal.FINISHED_PROMPT_TOKENS) == stats.finished_prompt_tokens
        assert snap.get(Signal.GENERATION_TOKENS) == stats.finished_generation_tokens
        return
    assert snap.get(Signal.PROMPT_TOKENS) == stats.prompt_tokens
    assert snap.get(Signal.GENERATION_TOKENS) == stats.generation_tokens
    if fields["engine"] == "vllm":
        assert snap.get(Signal.PREFILL_TIME_COUNT) == stats.prefill_time.count
        assert snap.get(Signal.QUEUE_TIME_SUM) == pytest.approx(stats.queue_time.sum)
        assert snap.lora is not None and snap.lora.max_lora == 1


def test_data_parallel_ranks_carry_engine_labels_and_sum_to_the_pod() -> None:
    text, engine = _render({"engine": "vllm", "data_parallel": 2})
    running = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running"]
    assert [s.labels["engine"] for s in running] == ["0", "1"]
    assert sum(s.value for s in running) == len(engine.running)
    assert metrics_text.split_count(7, 3) == [3, 2, 2]


@pytest.mark.parametrize(("fields", "gone"), [
    ({"engine": "vllm", "omit_metrics": ["vllm:request_prefill_time_seconds",
                                         "vllm:request_queue_time_seconds"]},
     {"vllm:request_prefill_time_seconds", "vllm:request_queue_time_seconds"}),
    ({"engine": "sglang", "metrics_version": "sglang-0.4"},
     {"sglang:queue_time_seconds", "sglang:cache_config_info",
      "sglang:inter_token_latency_seconds"}),
], ids=["vllm-omit", "sglang-0.4"])
def test_subsets_remove_the_families(fields: dict[str, Any], gone: set[str]) -> None:
    text, _ = _render(fields)
    names = {f.name for f in text_string_to_metric_families(text)}
    full, _ = _render({"engine": fields["engine"]})
    full_names = {f.name for f in text_string_to_metric_families(full)}
    assert gone <= full_names
    assert not gone & names
    snap = parse_metrics(text, profile_for(fields["engine"]))
    assert Signal.QUEUE_TIME_COUNT not in snap.values


def test_triton_2025_02_has_no_waiting_count_and_fails_the_gateway() -> None:
    """The real 2025-02 page has no request_type="waiting" and no KV fraction, so the
    gateway counts its scrape as failed (expected-trtllm.yaml); ours must do the same."""
    text, _ = _render({"engine": "trtllm", "metrics_version": "triton-trtllm-2025-02"})
    assert 'request_type="waiting"' not in text and 'kv_cache_block_type="fraction"' not in text
    assert 'request_type="scheduled"' in text
    with pytest.raises(ValueError, match="missing required"):
        parse_metrics(text, profile_for("trtllm"))


@pytest.mark.parametrize(("fields", "message"), [
    ({"engine": "sglang", "data_parallel": 2}, "data_parallel"),
    ({"engine": "vllm", "metrics_version": "vllm-0.8", "data_parallel": 2}, "data_parallel"),
    ({"engine": "vllm", "metrics_version": "sglang-0.4"}, "metrics_version"),
    ({"engine": "vllm", "omit_metrics": ["sglang:token_usage"]}, "omit_metrics"),
], ids=["dp-sglang", "dp-old-vllm", "version-engine", "omit-unknown"])
def test_invalid_page_options_are_spec_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_fleet({"pods": [{"gpu": "h100", "model": MODEL, **fields}]})


def test_get_load_shape_and_numbers() -> None:
    engine, _ = _busy_engine({"engine": "sglang"})
    [load] = sglang_load(engine)
    assert set(load) == {"rid", "http_worker_ipc", "dp_rank", "num_reqs", "num_waiting_reqs",
                         "num_tokens"}
    assert load["dp_rank"] == 0
    assert load["num_reqs"] == len(engine.running) + len(engine.waiting)
    assert load["num_waiting_reqs"] == len(engine.waiting)
    assert load["num_tokens"] == (engine.kv.used_blocks * engine.profile.block_size
                                  + sum(r.prompt_tokens for r in engine.waiting))


async def test_get_load_served_by_sglang_pods_only() -> None:
    spec = {"pods": [{"name": "s", "gpu": "h100", "model": MODEL, "engine": "sglang"},
                     {"name": "v", "gpu": "h100", "model": MODEL}]}
    async with Fleet.from_spec(spec) as fleet, ClientSession() as http:
        async with http.get(fleet.pod("s").url + "/get_load") as resp:
            assert resp.status == 200
            body = orjson.loads(await resp.read())
        assert body == [{"rid": None, "http_worker_ipc": None, "dp_rank": 0, "num_reqs": 0,
                         "num_waiting_reqs": 0, "num_tokens": 0}]
        async with http.get(fleet.pod("v").url + "/get_load") as resp:
            assert resp.status == 404
        assert fleet.pod("s").state()["get_load_calls"] == 1
        async with http.get(fleet.pod("s").url + "/metrics") as resp:
            assert "sglang:num_queue_reqs" in await resp.text()
