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
from bench.loadgen import LoadGenerator
from bench.replicas import ReplicatedGateway, coordination_missing, replica_spec
from bench.runner import tls_material
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
