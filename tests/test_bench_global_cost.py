"""bench.global_cost's pieces: the priority front (shape, and the real Envoy accepts it),
the seeded workload, the per-front summary, and a tiny run of the whole benchmark on the
real demo (slow suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bench.global_cost import LEVELS, PRICES, summarize, workload
from bench.loadgen import Result
from bench.priority_front import PRIORITY_ORDER, render_priority_bootstrap
from contract import headers as hdr
from contract.global_config import parse_global_config
from igw_envoy.binary import validate_config
from igw_envoy.tls import ensure_self_signed

REPO = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path):
    ca = ensure_self_signed(tmp_path / "region-ca", ("127.0.0.2",)).ca_cert
    regions = [{"name": name, "endpoint": f"127.0.0.{i + 2}:9443", "caFile": str(ca)}
               for i, name in enumerate(("eu-west-1", "us-east-1", "us-west-2"))]
    return parse_global_config({
        "apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
        "spec": {"regions": regions, "listener": {"address": "127.0.0.1", "port": 18443}},
    })


@pytest.fixture
def bootstrap(tmp_path: Path) -> dict:
    return render_priority_bootstrap(_config(tmp_path), tmp_path / "state", 18444, 19911)


def test_the_real_envoy_accepts_the_priority_front(tmp_path: Path, bootstrap: dict) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    validate_config(path)


def test_one_priority_per_region_in_the_users_order_each_naming_its_region(
        bootstrap: dict) -> None:
    (cluster,) = bootstrap["static_resources"]["clusters"]
    localities = cluster["load_assignment"]["endpoints"]
    assert [loc["priority"] for loc in localities] == [0, 1, 2]
    names = [loc["lb_endpoints"][0]["metadata"]["filter_metadata"]["igw"]["region"]
             for loc in localities]
    assert tuple(names) == PRIORITY_ORDER  # config order was eu, us-east, us-west
    assert "load_balancing_policy" not in cluster  # Envoy's own balancing, no router
    assert cluster["health_checks"] and cluster["outlier_detection"]
    assert {m["name"] for m in cluster["transport_socket_matches"]} == set(names)


def test_retries_move_to_another_priority_and_answers_name_the_region(bootstrap: dict) -> None:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][-1]
    policy = route["route"]["retry_policy"]
    assert policy["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    assert {"connect-failure", "reset", "5xx"} <= set(policy["retry_on"].split(","))
    assert policy["num_retries"] == 2
    (added,) = route["response_headers_to_add"]
    assert added["header"]["key"] == hdr.REGION


def test_the_workload_is_the_same_for_every_front_and_differs_by_level() -> None:
    first = workload(LEVELS["medium"], 10.0, seed=3)
    again = workload(LEVELS["medium"], 10.0, seed=3)
    assert [(s.at, s.body) for s in first] == [(s.at, s.body) for s in again]
    assert 15 <= len(first) <= 45  # ~3/s for 10 s
    assert len({s.body for s in first}) == len(first)
    bursty = workload(LEVELS["bursty"], 10.0, seed=3)
    assert [s.at for s in bursty] != [s.at for s in first]
    assert all(b"include_usage" in s.body for s in first)


def _result(i: int, ttft: float | None, pod: str, error: str = "") -> Result:
    return Result(index=i, model="m", group="", scheduled_s=0.0, lateness_ms=0.0,
                  status=200 if not error else 503, error=error, ttft_s=ttft, e2e_s=None,
                  output_tokens=100, prompt_tokens=900, pod=pod, done_at_s=None)


def test_summary_prices_tokens_at_the_serving_region_and_failures_miss_the_slo() -> None:
    results = [_result(0, 0.1, "us-east-1"), _result(1, 0.5, "eu-west-1"),
               _result(2, 0.3, "eu-west-1"), _result(3, None, "", error="http 503")]
    row = summarize(results, slo_s=0.4)
    assert row["requests"] == 4 and row["failed"] == 1
    assert row["within_slo_pct"] == 50.0  # 0.1 and 0.3 of four
    assert row["tokens"] == 3000
    expected = 1000 * (PRICES["us-east-1"] + 2 * PRICES["eu-west-1"]) / 1e6
    assert row["cost_usd"] == pytest.approx(expected)
    assert row["cost_per_million"] == pytest.approx(1e6 * expected / 3000)
    assert row["regions"] == {"eu-west-1": 2, "us-east-1": 1}


@pytest.mark.slow
def test_a_tiny_run_of_the_benchmark_end_to_end(tmp_path: Path) -> None:
    """The real demo, three fronts, a few requests each: every request answered and
    priced, the priority front on its first region, the report written."""
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-m", "bench.global_cost", "--duration", "3", "--levels", "light",
         "--fronts", "cheapest-within-slo,fastest,priority", "--out", str(out),
         "--work", str(tmp_path / "work")],
        cwd=REPO, check=True, timeout=400)
    doc = json.loads((out / "global-cost.json").read_text())
    rows = {r["front"]: r for r in doc["rows"]}
    assert set(rows) == {"cheapest-within-slo", "fastest", "priority"}
    for row in rows.values():
        assert row["requests"] >= 1 and row["failed"] == 0, row
        assert sum(row["regions"].values()) == row["requests"], row
        assert set(row["regions"]) <= set(PRICES), row
    assert set(rows["priority"]["regions"]) == {PRIORITY_ORDER[0]}
    assert rows["fastest"]["cost_vs_fastest"] == pytest.approx(1.0)
    assert "| light" in (out / "global-cost.md").read_text()
