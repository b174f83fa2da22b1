"""`igw bench --smoke` end to end: a two-pod fleet, the gateway (llm-d) and plain Envoy
round-robin, a few seconds each. Keeps the benchmark harness from rotting."""

from __future__ import annotations

import json

from bench.cli import main


def test_bench_smoke(tmp_path):
    out = tmp_path / "results"
    code = main(["--smoke", "--no-progress", "--out", str(out), "--work", str(tmp_path / "w")])
    assert code == 0
    report = (out / "REPORT.md").read_text()
    assert "gateway llm-d" in report and "Envoy ROUND_ROBIN" in report
    assert "Perfect-information replay" in report and "gateway vs best-ttft" in report
    doc = json.loads((out / "tiny.json").read_text())
    assert set(doc["replay"]) == {"round-robin", "least-work", "best-ttft"}
    assert doc["replay"]["best-ttft"]["ttft_p95"] <= doc["replay"]["round-robin"]["ttft_p95"]
    by = {s["router"]: s for s in doc["summaries"]}
    assert set(by) == {"igw-llm-d", "envoy-rr"}
    for s in by.values():
        assert s["ok"], s
        assert s["requests"] > 20
        assert s["errors"] == 0, s["error_kinds"]
        assert s["ttft_p95"] is not None and s["output_tokens_per_s"] > 0
    # every request of a run has its figures, and every pod's queue was sampled
    for run in doc["runs"]:
        results = run["results"]
        assert len(results["ttft_s"]) == by[run["router"]]["requests"]
        assert run["queues"] and len(run["queues"][0]["pods"]) == 2
        assert run["cpu"]["cpu_s"]["simulator"] > 0
    # one H100 and one A10G at half of round-robin capacity: round-robin splits evenly,
    # the gateway sends most requests to the pod that prefills ~14x faster (the pods are
    # named by the simulator's x-sim-pod header, which both routers pass through)
    rr, ours = by["envoy-rr"]["pods"], by["igw-llm-d"]["pods"]
    assert abs(rr["8b-h100-0"] - rr["8b-a10g-0"]) <= 2
    assert ours["8b-h100-0"] > 3 * ours.get("8b-a10g-0", 0)
