"""The perfect-information replay (bench/replay.py): the simulator's engine model stepped in
virtual time, under round-robin, least-work and best-ttft routing."""

from __future__ import annotations

import random

import orjson
import pytest

from bench.replay import POLICIES, replay, replay_reference
from bench.scenarios import SCENARIOS, Plan, PoolPlan
from bench.workload import Corpus, RequestSpec
from simulator.profiles import build_profile
from simulator.server import build_request

MODEL = "llama-3.1-8b"
CORPUS = Corpus(random.Random(0), chars=200_000)


def _spec(index: int, at: float, tokens: int, out: int = 8, model: str = MODEL,
          pool: str = MODEL) -> RequestSpec:
    body = {"model": model, "messages": [{"role": "user", "content": CORPUS.text_of(tokens)}],
            "max_tokens": out, "stream": True}
    return RequestSpec(index=index, at=at, model=model, pool=pool, body=orjson.dumps(body),
                       prompt_tokens=tokens, max_tokens=out)


def _plan(gpus: list[str], specs: list[RequestSpec]) -> Plan:
    pods = [{"name": f"p{i}-{g}", "gpu": g, "model": MODEL} for i, g in enumerate(gpus)]
    return Plan("t", [PoolPlan(MODEL, pods, 1.0, [1.0] * len(pods))], 1.0, 10.0, specs)


def _engine_tokens(spec: RequestSpec) -> int:
    req, _ = build_request(orjson.loads(spec.body), spec.model, MODEL, True)
    return req.prompt_tokens


def test_lone_request_takes_one_iteration_of_the_engine_model():
    spec = _spec(0, 0.5, 1000)
    res = replay(_plan(["a10g"], [spec]), "round-robin")
    prof = build_profile("a10g", MODEL)
    expected = prof.step_s(1) + _engine_tokens(spec) / prof.prefill_tokens_per_s
    assert res.ttft_s[0] == pytest.approx(expected, rel=1e-9)
    assert res.pods == ["p0-a10g"]


def test_round_robin_rotates_and_best_ttft_avoids_the_pod_busy_with_a_long_prefill():
    # A 6k-token prompt lands on p0; the third request would follow it there in rotation.
    specs = [_spec(0, 0.0, 6000), _spec(1, 0.01, 100), _spec(2, 0.02, 100)]
    rr = replay(_plan(["a10g", "a10g"], specs), "round-robin")
    best = replay(_plan(["a10g", "a10g"], specs), "best-ttft")
    assert rr.pods == ["p0-a10g", "p1-a10g", "p0-a10g"]
    assert best.pods[2] == "p1-a10g"
    assert best.ttft_s[2] < rr.ttft_s[2] / 3


def test_best_ttft_weighs_speed_against_queue():
    # An idle A10G against an H100 already busy with one short prefill: the H100 still wins.
    specs = [_spec(0, 0.0, 200, out=64), _spec(1, 0.001, 2000)]
    best = replay(_plan(["h100", "a10g"], specs), "best-ttft")
    assert best.pods == ["p0-h100", "p0-h100"]
    lone = build_profile("a10g", MODEL).prefill_tokens_per_s
    assert best.ttft_s[1] < _engine_tokens(specs[1]) / lone


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown replay policy"):
        replay(_plan(["a10g"], [_spec(0, 0.0, 10)]), "fastest")


def test_bursty_reference_orders_policies_and_is_deterministic():
    plan = SCENARIOS["bursty"].plan(0)
    ref = replay_reference(plan)
    assert set(ref) == set(POLICIES)
    rr, best = ref["round-robin"], ref["best-ttft"]
    assert best["ttft_p95"] < 0.7 * rr["ttft_p95"]
    assert ref["least-work"]["ttft_p95"] < rr["ttft_p95"]
    assert replay(plan, "best-ttft").ttft_s == replay(plan, "best-ttft").ttft_s


def test_pools_stay_separate_and_are_reported_per_pool():
    plan = SCENARIOS["mixed"].plan(0)
    res = replay(plan, "least-work")
    names = {pool.model: {p["name"] for p in pool.pods} for pool in plan.pools}
    assert all(pod in names[spec.pool] for spec, pod in zip(plan.requests, res.pods, strict=True))
    assert None not in res.ttft_s
    ref = replay_reference(plan, ["round-robin"])
    assert set(ref["round-robin"]["per_pool"]) == set(names)


def test_lora_requests_use_adapter_slots():
    plan = SCENARIOS["lora"].plan(0)
    rr, best = replay(plan, "round-robin"), replay(plan, "best-ttft")
    assert None not in rr.ttft_s and None not in best.ttft_s
    # Round-robin queues adapters behind full slots; choosing where they are resident does not.
    assert best.percentiles()["ttft_p95"] < 0.5 * rr.percentiles()["ttft_p95"]


def test_cli_prints_the_replay_without_starting_anything(capsys):
    from bench.cli import main

    assert main(["--replay", "--scenario", "tiny", "--seed", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("tiny (seed 2, ")
    for policy in POLICIES:
        assert f"{policy} " in line
    assert "best-ttft vs round-robin p95 " in line
