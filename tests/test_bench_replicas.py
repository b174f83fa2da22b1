"""bench/replicas.py end to end: two `igw serve` replicas behind the Envoy `tcp_proxy`
front over a two-pod simulated fleet serve a handful of streamed requests, and the front
spreads the clients' connections over both replicas. Uncoordinated, and coordinated through
a real redis-server once the gateway config has `spec.coordination`. No timing assertions."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from bench.fleet import SimFleet
from bench.loadgen import LoadGenerator, Result
from bench.replicas import (
    SHARING_COUNTERS,
    ReplicatedGateway,
    _cell,
    coordination_missing,
    metric_values,
    pooled_summary,
    replica_spec,
    replica_table,
    scrape_table,
    scrape_totals,
)
from bench.runner import RunResult, tls_material
from bench.scenarios import SCENARIOS

REQUESTS = 24


def _serve_a_few(tmp_path: Path, coordinated: bool) -> dict:
    """Start fleet + replicas, send REQUESTS requests, return the router's diagnostics."""
    plan = SCENARIOS["tiny"].plan(0, 1.0)
    tls = tls_material(tmp_path)
    fleet = SimFleet.start(tmp_path / "fleet", plan.pods, seed=0, time_scale=plan.time_scale)
    router = ReplicatedGateway(replica_spec(2, coordinated))
    try:
        router.start(tmp_path, fleet, tls, plan.time_scale)
        router.wait_ready(fleet)
        router.before_measure()
        gen = LoadGenerator(plan.requests[:REQUESTS], lambda r: router.url_for_pool(r.pool),
                            time_scale=plan.time_scale, time_cap_s=30.0,
                            ssl_context=ssl.create_default_context(cafile=str(tls.ca)),
                            clients=router.clients)
        results = asyncio.run(gen.run())
        assert len(results) == min(REQUESTS, len(plan.requests))
        assert all(r.status == 200 and r.error == "" for r in results), results
        if coordinated:
            assert router.children[0].name == "redis-server" and router.children[0].alive()
        return router.diagnostics()
    finally:
        router.stop()
        fleet.stop()


def _both_replicas_used(diag: dict) -> None:
    assert "error" not in diag, diag
    rows = diag["per_replica"]
    assert len(rows) == 2
    assert all(row["connections"] > 0 and row["requests"] > 0 for row in rows), diag
    assert sum(row["requests"] for row in rows) == REQUESTS


def test_two_uncoordinated_replicas_share_connections(tmp_path):
    _both_replicas_used(_serve_a_few(tmp_path, coordinated=False))


@pytest.mark.skipif(coordination_missing() is not None,
                    reason=f"coordinated replicas: {coordination_missing()}")
def test_two_coordinated_replicas_with_redis(tmp_path):
    _both_replicas_used(_serve_a_few(tmp_path, coordinated=True))


def test_scrape_load_reads_own_scrapes_and_sharing_and_tabulates_both():
    text = "\n".join([
        '# HELP igw_pod_scrapes_total x',
        'igw_pod_scrapes_total{outcome="ok",pod="p0",pool="a"} 40.0',
        'igw_pod_scrapes_total{outcome="failed",pod="p0",pool="a"} 2.0',
        'igw_coordination_shared_scrapes_received_total{result="used"} 17.0',
        'igw_coordination_shared_scrapes_received_total{result="ignored"} 3.0',
        'igw_coordination_scrape_fallbacks_total 1.0',
    ])
    assert scrape_totals(text) == {"p0": 42.0}
    assert metric_values(text, SHARING_COUNTERS) == {"shared_used": 17.0, "fallbacks": 1.0}
    assert metric_values("", SHARING_COUNTERS) == {"shared_used": 0.0, "fallbacks": 0.0}
    run = {"scrapes_per_s_per_pod": 19.5, "simulator_core_share": 0.08,
           "simulator_us_per_scrape": 400.0, "picker_core_share_each": [0.1, 0.12]}
    load = {"pods": 10, "seconds": 8, "idle_simulator_core_share": 0.0,
            "vllm_page": {"us_per_scrape": 2500.0, "lines": 427, "bytes": 35018},
            "runs": {"2": {**run, "scrapes_per_s_per_pod": 39.0}},
            "shared_runs": {"2": {**run, "shared_used_per_s_per_pod": 19.5,
                                  "fallbacks_per_s": 0.0}}}
    rows = [line for line in scrape_table(load) if line.startswith("| 2")]
    assert rows == [
        "| 2, not coordinated | 39.0 | n/a | 8.0 % | 400 µs | 10.0 %, 12.0 % | 10 % of a core |",
        "| 2, coordinated, shared | 19.5 | 19.5 (0.0) | 8.0 % | 400 µs | 10.0 %, 12.0 % "
        "| 5 % of a core |",
    ]


def test_pooled_summary_says_how_late_the_fleet_itself_was():
    """Each repeat's fleet lateness (its worst pod's p99) is kept and shown beside the
    repeats' p95: on 2 shared cores a change at N = 4 may be the simulator's own delay."""
    def run(late: list[float]) -> RunResult:
        pods = {f"p{i}": {"lateness_ms": {"p99": v}} for i, v in enumerate(late)}
        results = [Result(index=i, model="m", group="", scheduled_s=0.1 * i, lateness_ms=0.0,
                          status=200, error="", ttft_s=0.01 * (i + 1), e2e_s=0.5,
                          output_tokens=10, prompt_tokens=100, pod="p0", done_at_s=0.1 * i + 0.5)
                   for i in range(20)]
        return RunResult("igw-llm-d-x4", "x4", True, results=results, pods=pods)

    summary = pooled_summary([run([0.4, 3.25]), run([1.0, 0.5])])
    assert summary["fleet_late_p99_ms"] == [3.25, 1.0]
    assert _cell(summary).endswith("fleet late p99 3.2, 1.0 ms")


def test_a_rerun_is_compared_with_its_own_single_gateway():
    """A rerun of N = 1 and 4 (coordinated) merged beside an older full table: N = 4 is
    compared with the N = 1 of its own run, the older uncoordinated rows with theirs."""
    def summary(p95: float, command: str) -> dict:
        return {"repeats": 1, "ttft_p50": 0.01, "ttft_p95": p95, "ttft_p99": p95,
                "ttft_p95_each": [p95], "ttft_p95_median": p95, "connections_share": [None],
                "requests_share": [None], "command": command, "date": "d"}

    old, new = "igw bench --replicas 1,2,4 --compare-coordination", "igw bench --replicas 1,4"
    doc = {"scenarios": {"s": {
        "igw-llm-d-x1-nocoord": summary(0.100, old), "igw-llm-d-x2-nocoord": summary(0.150, old),
        "igw-llm-d-x2": summary(0.105, old), "igw-llm-d-x4-nocoord": summary(0.130, old),
        "igw-llm-d-x1": summary(0.050, new), "igw-llm-d-x4": summary(0.054, new)}}}
    rows = {line.split(" | ")[1]: line.split(" | ") for line in replica_table(doc)[2:]}
    assert rows["2"][3] == "+50 %" and rows["2"][5] == "+5 %" and rows["2"][6] == "met"
    assert rows["4"][3] == "+30 %" and rows["4"][5] == "+8 %" and rows["4"][6] == "met"
