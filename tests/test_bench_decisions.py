"""bench.decisions: the twin's per-decision diagnosis records without changing what it diagnoses."""

from __future__ import annotations

import math

from bench.decisions import Decision, DecisionLog, main, observe, summary
from bench.family import scenario
from bench.twin import Twin

# family-0-6: two pools (4 vLLM pods, 2 TensorRT-LLM pods), a few hundred requests, seconds.
SEED, MEMBER = 0, 6


def test_observing_changes_no_decision() -> None:
    """`Scheduler.explain` and the forked pods run at every dispatch; the twin's TTFTs and
    pods must be those of a run nobody watched."""
    plan = scenario(SEED, MEMBER)
    plain = Twin(plan, seed=1).run()
    log = DecisionLog()
    watched = Twin(plan, seed=1, observe=log).run()
    log.finish(watched.ttft_s)
    assert watched.ttft_s == plain.ttft_s
    assert watched.pods == plain.pods
    assert len(log.decisions) == sum(1 for pod in plain.pods if pod is not None)


def test_each_decision_names_its_pool_and_its_choice() -> None:
    decisions, ttfts = observe(SEED, MEMBER)
    assert decisions and len(ttfts) >= len([d for d in decisions if d.ttft is not None])
    plan = scenario(SEED, MEMBER)
    pools = {pod["name"]: pool.model for pool in plan.pools for pod in pool.pods}
    for d in decisions:
        assert d.chosen in d.truth  # every pod of the chosen pod's pool has a counterfactual
        assert {pools[p] for p in d.truth} == {pools[d.chosen]}
        assert set(d.predicted) | set(d.filtered) <= set(d.truth)
        assert d.regret >= 0.0
        assert all(t > 0 for t in d.truth.values())
    # some decision in this member had more than one candidate with a prediction
    assert any(len(d.predicted) > 1 for d in decisions)


def test_regret_and_summary() -> None:
    d = Decision(0, 1.0, 0.0, None, 100, truth={"a": 0.2, "b": 0.5}, chosen="b", ttft=0.5)
    assert math.isclose(d.regret, 0.3)
    d.chosen = "a"
    assert d.regret == 0.0
    info = summary([d], [0.1, 0.2, 0.5])
    assert info["requests"] == 3 and info["tail"]["decisions"] == 1
    assert info["all"]["missed_share"] == 0.0


def test_cli_prints_the_tail(capsys) -> None:
    assert main(["--seed", str(SEED), "--member", str(MEMBER), "--tail", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"family-{SEED}-{MEMBER} twin seed 0: ")
    assert any(line.startswith("tail: ") for line in out)
    assert sum(line.startswith("t=") for line in out) == 3
