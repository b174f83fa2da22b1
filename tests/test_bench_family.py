"""The scenario family (bench/family.py), the replay's adapter-affine yardstick and cheap pod
fork (bench/replay.py), and the gateway's twin (bench/twin.py)."""

from __future__ import annotations

import argparse
import copy
import random

import orjson
import pytest

from bench import family
from bench import replay as replay_module
from bench.capacity import Workload, round_robin_capacity
from bench.family import (
    ARRIVALS,
    MAX_ADAPTERS,
    MAX_SLOTS,
    PODS_RANGE,
    UTILIZATION_RANGE,
    WARMUP_GROUP,
    arrivals,
    draw_params,
    live_run,
    member_indices,
    sample,
    sample_of,
    scenario,
)
from bench.fleet import Pod, SimFleet
from bench.replay import measured_indices, replay
from bench.routers import ROUTERS, TlsMaterial, gateway_config
from bench.scenarios import SCENARIOS, Plan, PoolPlan, capacities, chat_request, make_pods
from bench.twin import check_row, twin
from bench.workload import Corpus, lognormal, poisson_arrivals

MODEL = "llama-3.1-8b"


def test_generator_is_deterministic_per_seed_and_index() -> None:
    assert draw_params(3, 7) == draw_params(3, 7)
    assert draw_params(3, 7) != draw_params(4, 7)
    first, again = scenario(1, 2), scenario(1, 2)
    assert first.requests == again.requests and first.pods == again.pods
    assert first.calibration["params"] == draw_params(1, 2)


def test_parameters_stay_in_their_ranges() -> None:
    kinds, engines = set(), set()
    for index in range(60):
        p = draw_params(0, index)
        pods = sum(n for pool in p["pools"] for _, n in pool["gpus"])
        assert PODS_RANGE[0] <= pods <= PODS_RANGE[1]
        assert UTILIZATION_RANGE[0] <= p["utilization"] <= UTILIZATION_RANGE[1]
        for pool in p["pools"]:
            assert 0 <= pool["adapters"] <= MAX_ADAPTERS
            if pool["adapters"]:
                assert 1 <= pool["slots"] <= MAX_SLOTS
            engines.add(pool["engine"])
        kinds.add(p["arrivals"]["kind"])
        if p["prefix"]:
            assert 1 <= p["prefix"]["groups"] <= 8
    assert kinds == set(ARRIVALS)
    assert engines == {"vllm", "sglang", "trtllm"}


@pytest.mark.parametrize("kind", ["ramp", "diurnal", "on-off"])
def test_arrival_shapes_keep_the_mean_rate(kind: str) -> None:
    shape = {"ramp": {"kind": "ramp", "swing": 0.6, "up": True},
             "diurnal": {"kind": "diurnal", "swing": 0.5, "periods": 2, "phase": 0.0},
             "on-off": {"kind": "on-off", "cycles": 4, "on_share": 0.3, "on_load": 2.0}}[kind]
    times = arrivals(random.Random(0), shape, 50.0, 200.0)
    assert len(times) == pytest.approx(50.0 * 200.0, rel=0.05)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 200.0


def test_family_plans_carry_a_warm_up_that_is_not_measured() -> None:
    plan = scenario(0, 0)
    measured = measured_indices(plan)
    assert measured[0] > 0 and len(measured) < len(plan.requests)
    assert all(r.max_tokens <= 16 for r in plan.requests[: measured[0]])


def test_fork_is_the_same_as_a_deep_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = SCENARIOS["tiny"].plan(0)
    fast = replay(plan, "best-ttft")
    monkeypatch.setattr(replay_module.ReplayPod, "fork", lambda self: copy.deepcopy(self))
    slow = replay(plan, "best-ttft")
    assert fast == slow


def test_adapter_affine_loads_fewer_adapters_than_round_robin() -> None:
    plan = SCENARIOS["lora"].plan(0, wall_duration_s=3.0)
    affine, rr = replay(plan, "adapter-affine"), replay(plan, "round-robin")
    assert 0 < affine.adapter_loads < rr.adapter_loads


def test_twin_routes_every_request_deterministically() -> None:
    plan = SCENARIOS["tiny"].plan(0)
    first, again = twin(plan), twin(plan)
    assert first == again
    assert all(t is not None and t > 0 for t in first.ttft_s)
    assert set(first.pods) == {p["name"] for p in plan.pods}


def _mixed_plan() -> Plan:
    """One H100 and three A10Gs at 80 % of round-robin capacity: rotation overloads the A10Gs."""
    rng = random.Random("twin-mixed")
    corpus = Corpus(rng, chars=300_000)
    pods = make_pods("h100", MODEL, 1, "m") + make_pods("a10g", MODEL, 3, "m")
    caps = capacities(pods, Workload(400, 400, 60))
    pool = PoolPlan(MODEL, pods, 0.8 * round_robin_capacity(caps), caps)
    reqs = [chat_request(i, t, MODEL, MODEL, corpus.text_of(lognormal(rng, 400, 0.6, 16, 2000)),
                         lognormal(rng, 60, 0.5, 4, 200), MODEL)
            for i, t in enumerate(poisson_arrivals(rng, pool.rate, 0.0, 20.0))]
    return Plan("twin-mixed", [pool], 1.0, 20.0, reqs)


def test_twin_gateway_beats_strict_round_robin_on_a_mixed_fleet() -> None:
    plan = _mixed_plan()
    gateway = twin(plan).percentiles()
    rr = replay(plan, "round-robin").percentiles()
    assert gateway["ttft_p95"] < 0.5 * rr["ttft_p95"]


def test_live_run_sends_the_members_warm_up_then_its_measured_requests_from_zero() -> None:
    member = sample(0, 1)[0]
    spec, measured, warm = live_run(member)
    assert spec.name == member.scenario and spec.plan(0) is measured
    assert warm.requests and all(r.group == WARMUP_GROUP for r in warm.requests)
    assert measured.requests and all(r.group != WARMUP_GROUP for r in measured.requests)
    assert len(warm.requests) + len(measured.requests) == len(member.requests)
    start = member.calibration["measured_from_s"]
    assert measured.requests[0].at == pytest.approx(member.requests[len(warm.requests)].at
                                                    - start)
    assert 0.0 <= measured.requests[0].at < measured.requests[-1].at <= measured.duration_s


def test_sample_of_keeps_the_members_asked_for_in_the_samples_order() -> None:
    whole = sample(0, 4)
    indices = [plan.calibration["params"]["index"] for plan in whole]
    assert [p.scenario for p in sample_of(0, 4)] == [p.scenario for p in whole]
    chosen = sample_of(0, 4, member_indices(f"{indices[2]},{indices[0]},999"))
    assert [p.scenario for p in chosen] == [whole[0].scenario, whole[2].scenario]
    with pytest.raises(argparse.ArgumentTypeError):
        member_indices("16,x")


def test_gateway_config_names_each_pools_engine(tmp_path) -> None:
    """A family pool of SGLang or TensorRT-LLM pods must be scraped with its own parser
    live, as the twin does (the vLLM parser refuses those pages)."""
    pods = [Pod("a", "h100", "llama-3.1-8b", 1, (), "sglang"),
            Pod("b", "l4", "qwen3-14b", 2, (), "trtllm")]
    fleet = SimFleet(None, pods, 0, tmp_path / "fleet.yaml")  # type: ignore[arg-type]
    tls = TlsMaterial(tmp_path / "ca", tmp_path / "cert", tmp_path / "key")
    config = gateway_config(ROUTERS["igw-llm-d"], fleet, tls, 1.0)
    assert [s["engineType"] for s in config["spec"]["schedulers"]] == ["sglang", "trtllm"]


def _row(name: str, vs_best: float, vs_rr: float) -> dict:
    params = family.scenario(0, 0).calibration["params"]
    yard = {k: {"ttft_p95": 1.0, "adapter_loads": 0} for k in family.YARDSTICKS}
    return {"name": name, "params": params, "gateway": {"ttft_p50": 0.5, "ttft_p95": vs_best,
            "ttft_p99": 2.0, "adapter_loads": 0, "failed": 0}, "yardsticks": yard,
            "ratios": {"vs_best_ttft": vs_best, "vs_round_robin": vs_rr,
                       "best_yardstick": "best-ttft", "vs_best_yardstick": vs_best,
                       "loads_vs_affine": None}}


def test_a_members_figures_are_the_median_over_the_twins_seeds() -> None:
    plan = scenario(0, 4)  # 15 vLLM pods: its p95 differs on each of the three seeds
    yard = {k: {"ttft_p95": 0.025, "adapter_loads": 0} for k in family.YARDSTICKS}
    row = family.run_scenario(plan, yard, family.twin_seeds(0, 3))
    measured = measured_indices(plan)
    each = [twin(plan, seed=s).percentiles(measured)["ttft_p95"] for s in (0, 1, 2)]
    assert len(set(each)) == 3
    assert row["gateway"]["p95_by_seed"] == each
    assert row["gateway"]["ttft_p95"] == sorted(each)[1]
    assert row["ratios"]["vs_best_ttft"] == round(sorted(each)[1] / 0.025, 3)
    agg = family.aggregate([row])
    assert agg["twin_seeds"] == [0, 1, 2]
    assert agg["seed_spread"]["worst"] == round(max(each) / min(each), 3)
    assert agg["share_within_target_every_seed"] == 0.0  # 0.025 x 1.2 is below every seed's
    one = family.run_scenario(plan, yard)  # the family's seed alone, as before
    assert one["gateway"]["ttft_p95"] == each[0] and "p95_by_seed" not in one["gateway"]
    assert "seed_spread" not in family.aggregate([one])


def test_a_family_run_in_worker_processes_gives_the_same_rows(tmp_path) -> None:
    yard = {k: {"ttft_p95": 1.0, "ttft_p50": 0.5, "ttft_p99": 2.0, "adapter_loads": 1}
            for k in family.YARDSTICKS}
    cached = [{"name": p.scenario, "fingerprint": family.fingerprint(p), "yardsticks": yard}
              for p in family.family(0, 2)]
    rows = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        out.mkdir()
        (out / "family.json").write_bytes(orjson.dumps({"scenarios": cached}))
        doc = family.run_family(0, 2, out, twin_only=True, seeds=1, jobs=jobs)
        rows[jobs] = [{k: v for k, v in r.items() if k != "seconds"} for r in doc["scenarios"]]
    assert [r["name"] for r in rows[1]] == ["family-0-0", "family-0-1"]
    assert all(r["yardsticks"] == yard for r in rows[1])  # the cached yardsticks were used
    assert rows[1] == rows[2]


def test_report_gains_a_family_section_replaced_on_each_run(tmp_path) -> None:
    rows = [_row(f"family-0-{i}", 1.0 + i / 10, 0.5 + i / 10) for i in range(6)]
    doc = {"seed": 0, "count": 6, "twin_only": True, "seconds": 1.0,
           "aggregate": family.aggregate(rows), "scenarios": rows}
    (tmp_path / "family.json").write_bytes(orjson.dumps(doc))
    assert not family.update_report(tmp_path / "nowhere")
    (tmp_path / "REPORT.md").write_text("# Routing benchmark report\n\n## mixed\n\nrows\n")
    assert family.update_report(tmp_path)
    first = (tmp_path / "REPORT.md").read_text()
    assert first.startswith("# Routing benchmark report\n\n## mixed\n\nrows\n\n## Scenario family")
    assert "| best-ttft | 1.25 | 1.45 | 1.50 | ≤ 1.2: 50% |" in first
    assert "- `family-0-5` (1.50x)" in first  # the worst named
    assert (tmp_path / family.FAMILY_PLOT).stat().st_size > 0
    assert f"]({family.FAMILY_PLOT})" in first
    family.update_report(tmp_path)  # a second run replaces the section, nothing else
    assert (tmp_path / "REPORT.md").read_text() == first


def _summary(p95: float) -> dict[str, float]:
    return {"ttft_p50": p95 / 3, "ttft_p95": p95, "ttft_p99": p95 * 1.5, "errors": 0}


def test_twin_check_ranks_against_round_robin_and_the_best_open_router(tmp_path) -> None:
    """The twin runs for real on the mixed plan; the live summaries are written here (what a
    live run's <member>.json holds), chosen to put the live gateway on known sides of 1."""
    plan = _mixed_plan()
    ours = twin(plan).percentiles(measured_indices(plan))["ttft_p95"]
    live = {"igw-llm-d": _summary(ours), "envoy-rr": _summary(4 * ours),
            "igw-epp": _summary(ours / 10),  # our own profile: not another router
            "sglang-cache": _summary(0.5 * ours), "vllm-p2": _summary(0.8 * ours)}
    row = check_row("twin-mixed", plan, live, 0)
    assert row["p95_ratio"] == 1.0 and row["live_vs_envoy_rr"] == 0.25
    assert row["twin_vs_round_robin"] < 1.0 and row["agrees"]["round_robin"] is True
    assert row["live_open_router"] == "sglang-cache" and row["live_vs_open_router"] == 2.0
    assert row["twin_other"] in ("least-work", "adapter-affine")
    # the twin beats least-work on a mixed fleet: it ranks the gateway ahead, live behind
    assert row["twin_vs_other"] < 1.0 and row["agrees"]["other"] is False
    del live["sglang-cache"], live["vllm-p2"]
    alone = check_row("twin-mixed", plan, live, 0)
    assert "live_open_router" not in alone and alone["agrees"]["other"] is None
    doc = {"date": "today", "command": "igw bench --family 2 --twin-check", "seed": 0,
           "routers": sorted(live), "rows": [row, alone]}
    (tmp_path / family.LIVE_SAMPLE).write_bytes(orjson.dumps(doc))
    (tmp_path / "family.json").write_bytes(orjson.dumps(
        {"seed": 0, "count": 1, "twin_only": True, "seconds": 1.0,
         "aggregate": family.aggregate([_row("family-0-0", 1.0, 0.5)]),
         "scenarios": [_row("family-0-0", 1.0, 0.5)]}))
    assert family.update_report(tmp_path)
    text = (tmp_path / "REPORT.md").read_text()
    assert "### The family's sample live (2 members, today)" in text
    assert "| ✓ |" in text and "| ✗ |" in text and "(none ran) | n/a |" in text
    assert "Against round-robin the twin ranks the gateway as live in 2 of 2 members." in text
    assert "Against the best other the twin ranks the gateway as live in 0 of 1 members." in text


def test_twin_holds_requests_in_the_gateways_admission_once_slots_are_learned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pods of 4 batch slots under twice their capacity: once two scrapes have shown a
    queue, the twin's admission (the gateway's picker.scheduling.admission.Admission) holds
    requests, and no request is dispatched while the pool's in flight is at its slots plus
    slotAllowance. Fails if the twin routes past flow control (the old admission held only
    on the engines' waiting counts)."""
    from bench import twin as twin_module
    from picker.scheduling.flow import routable_rows, slots_room

    rng = random.Random("twin-flow")
    corpus = Corpus(rng, chars=200_000)
    pods = make_pods("h100", MODEL, 2, "f")
    for pod in pods:
        pod["max_num_seqs"] = 4
    caps = capacities(pods, Workload(300, 300, 80))
    pool = PoolPlan(MODEL, pods, 2.0 * round_robin_capacity(caps), caps)
    reqs = [chat_request(i, t, MODEL, MODEL, corpus.text_of(lognormal(rng, 300, 0.5, 16, 1000)),
                         lognormal(rng, 80, 0.4, 8, 200), MODEL)
            for i, t in enumerate(poisson_arrivals(rng, pool.rate, 0.0, 4.0))]
    plan = Plan("twin-flow", [pool], 1.0, 4.0, reqs)
    checked = {"dispatches": 0, "bound": 0, "held": 0}
    dispatch, hold = twin_module.Twin._dispatch, twin_module.Twin._hold

    def checked_dispatch(self, gateway, tp, sent, t):  # type: ignore[no-untyped-def]
        state, now = tp.scheduler.state, t / self.scale
        rows = routable_rows(state, now)
        if len(rows) and state.slot_limits(rows).min() > 0:
            checked["bound"] += 1
            assert slots_room(state, rows), "dispatched past the pool's slots"
        checked["dispatches"] += 1
        dispatch(self, gateway, tp, sent, t)

    def counted_hold(self, gateway, tp, sent, t):  # type: ignore[no-untyped-def]
        checked["held"] += 1
        hold(self, gateway, tp, sent, t)

    monkeypatch.setattr(twin_module.Twin, "_dispatch", checked_dispatch)
    monkeypatch.setattr(twin_module.Twin, "_hold", counted_hold)
    result = twin(plan)
    assert checked["dispatches"] >= 0.9 * len(reqs) and checked["bound"] > 20
    assert checked["held"] > 20
    assert sum(t is not None for t in result.ttft_s) >= 0.9 * len(reqs)
