"""Pieces of the routing benchmark that need no process: capacity model, workloads,
SSE parsing, summaries, the Envoy baseline bootstrap."""

from __future__ import annotations

import argparse
import random

import orjson
import pytest

from bench import envoy_baseline
from bench.capacity import Workload, pod_capacity, round_robin_capacity
from bench.cli import _named
from bench.loadgen import Result, _content_event, _usage_tokens
from bench.report import change, comparison, summarize
from bench.runner import RunResult, warmup_requests
from bench.scenarios import ALL, SCENARIOS
from bench.workload import on_off_arrivals, poisson_arrivals

CHAT = Workload(600, 600, 190)


def test_capacity_orders_gpus_and_sizes():
    h100 = pod_capacity("h100", "llama-3.1-8b", CHAT)
    a10g = pod_capacity("a10g", "llama-3.1-8b", CHAT)
    assert h100 > 10 * a10g > 0
    assert pod_capacity("h100", "llama-3.1-70b", CHAT) < h100
    # fewer batch slots or more work per request: less capacity
    assert pod_capacity("h100", "llama-3.1-8b", CHAT, max_num_seqs=32) < h100
    assert pod_capacity("h100", "llama-3.1-8b", Workload(2000, 2000, 190)) < h100
    assert round_robin_capacity([10.0, 1.0, 1.0]) == 3.0


def test_another_time_scale_alone_keeps_the_arrivals():
    """Real-time reruns (`--time-scale 1`) compare with the default runs only if they
    replay the same requests at the same model times."""
    scenario = SCENARIOS["lora"]
    default, real_time = scenario.plan(0), scenario.plan(0, time_scale=1.0)
    assert real_time.time_scale == 1.0 and real_time.duration_s == default.duration_s
    assert [(r.at, r.body) for r in real_time.requests] == [
        (r.at, r.body) for r in default.requests]
    assert scenario.plan(0, 3.0, 1.0).duration_s == 3.0


def test_a_comparison_of_replicas_runs_the_prefix_plan_four_times_as_long():
    """`--replicas` compares p95s within 10 %; the published prefix plan's p95 is ~0.7 or
    ~1.1 s by one tail request, so its comparison plan is longer. The others are unchanged,
    and an explicit --duration still wins."""
    prefix, lora = SCENARIOS["prefix"], SCENARIOS["lora"]
    published, compared = prefix.plan(0), prefix.plan(0, comparison=True)
    assert compared.duration_s == 4 * published.duration_s
    assert len(compared.requests) > 3.5 * len(published.requests)
    assert prefix.plan(0, 3.0, 1.0, comparison=True).duration_s == 3.0
    assert lora.plan(0, comparison=True).duration_s == lora.plan(0).duration_s
    args = argparse.Namespace(seed=0, duration=None, time_scale=1.0)
    (_, live, _), = _named(["prefix"], args, comparison=True)  # what `--replicas` sends
    assert live.duration_s == compared.duration_s and live.time_scale == 1.0


@pytest.mark.parametrize("name", [*ALL, "tiny"])
def test_scenarios_are_seeded_and_calibrated(name):
    scenario = SCENARIOS[name]
    a = scenario.plan(7, wall_duration_s=4)
    b = scenario.plan(7, wall_duration_s=4)
    c = scenario.plan(8, wall_duration_s=4)
    assert [(r.at, r.body) for r in a.requests] == [(r.at, r.body) for r in b.requests]
    assert [r.body for r in a.requests] != [r.body for r in c.requests]
    assert a.requests and all(0 <= r.at < a.duration_s for r in a.requests)
    assert [r.at for r in a.requests] == sorted(r.at for r in a.requests)
    for req in a.requests:
        body = orjson.loads(req.body)
        assert body["stream"] is True and body["max_tokens"] == req.max_tokens
        assert body["model"] == req.model
    for pool in a.pools:
        assert 0 < pool.rate <= pool.rr_capacity
    served = {p["model"] for p in a.pods} | {ad for p in a.pods for ad in p.get("lora_adapters",
                                                                               ())}
    assert {r.model for r in a.requests} <= served


def test_prefix_requests_share_system_prompts_only():
    plan = SCENARIOS["prefix"].plan(0, wall_duration_s=4)
    systems = {orjson.loads(r.body)["messages"][0]["content"] for r in plan.requests}
    users = [orjson.loads(r.body)["messages"][1]["content"][:64] for r in plan.requests]
    assert 1 < len(systems) <= 6
    assert len(set(users)) == len(users)


def test_arrival_processes():
    rng = random.Random(1)
    times = list(poisson_arrivals(rng, 50.0, 0.0, 100.0))
    assert 4500 < len(times) < 5500
    bursts = on_off_arrivals(random.Random(2), rate_on=100, rate_off=10, on_s=2, off_s=8,
                             duration=100)
    on = sum(1 for t in bursts if (t % 10) >= 8)
    off = len(bursts) - on
    assert on > 1.5 * off  # 2 s at 100/s vs 8 s at 10/s per cycle


def test_warmup_caps_outputs():
    plan = SCENARIOS["mixed"].plan(3, wall_duration_s=2)
    warm = warmup_requests(plan)
    assert len(warm) == len(plan.requests)
    assert all(orjson.loads(w.body)["max_tokens"] <= 16 for w in warm)


def test_sse_parsing():
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    token = b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}'
    text = b'data: {"choices":[{"index":0,"text":"hi"}]}'
    assert not _content_event(role)
    assert _content_event(token) and _content_event(text)
    assert not _content_event(b"data: [DONE]")
    tail = (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":42}}\n\n'
            b"data: [DONE]\n\n")
    assert _usage_tokens(b"xx\n\n" + tail) == 42
    assert _usage_tokens(b"data: [DONE]\n\n") is None


def _result(i: int, ttft: float, error: str = "", pod: str = "p") -> Result:
    return Result(index=i, model="m", group="m", scheduled_s=i * 0.1, lateness_ms=0.5,
                  status=200, error=error, ttft_s=ttft, e2e_s=None if error else ttft + 1,
                  output_tokens=10, prompt_tokens=100, pod=pod, done_at_s=i * 0.1 + 1.1,
                  tokens_in_window=10)


def test_summary_and_comparison():
    plan = SCENARIOS["tiny"].plan(0, wall_duration_s=2)
    fast = RunResult("igw-llm-d", "gateway", True,
                     results=[_result(i, 0.1) for i in range(100)])
    slow = RunResult("envoy-rr", "envoy", True,
                     results=[_result(i, 0.5 if i % 10 else 2.0) for i in range(99)]
                     + [_result(99, 3.0, error="cut")])
    failed = RunResult("sglang-rr", "sglang", False, error="did not start")
    sums = [summarize(r, plan) for r in (fast, slow, failed)]
    assert sums[0]["ttft_p50"] == pytest.approx(0.1)
    assert sums[1]["errors"] == 1 and sums[1]["error_kinds"] == {"cut": 1}
    assert sums[1]["ttft_p99"] >= 2.0
    assert sums[2]["ok"] is False
    comp = comparison(sums)
    assert comp["vs_baseline"]["ttft_p95"] < -90
    assert comp["best_peer"] is None
    assert change(1.0, 2.0) == -50.0 and change(1.0, None) is None


def test_envoy_baseline_bootstrap():
    config = envoy_baseline.bootstrap(
        "LEAST_REQUEST", {"m": (9000, ["127.0.0.1:1", "127.0.0.1:2"])}, 9901, None)
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    with pytest.raises(ValueError):
        envoy_baseline.bootstrap("MAGLEV", {}, 9901, None)


def test_a_router_start_that_lost_its_port_is_run_again():
    """Only a port taken between the pick and the bind is the test bed's race; any other
    failure to start is the router's and is reported as it is."""
    from bench.runner import RunResult, _port_taken

    lost = ("bench.procs.StartError: igw serve not ready (exit 1); log tail:\nOSError: "
            "[Errno 98] error while attempting to bind on address ('127.0.0.1', 59251): "
            "address already in use")
    assert _port_taken(RunResult("r", "r", False, error=lost))
    assert not _port_taken(RunResult("r", "r", False, error="igw serve not ready (exit 2)"))
    assert not _port_taken(RunResult("r", "r", True))
