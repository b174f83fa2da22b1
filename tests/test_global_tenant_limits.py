"""One tenant limit, two real global-router replicas, concurrent load: the total holds ±5 %.

Two `igw global serve` (router + Envoy each) on the same GlobalRouterConfig (only the
ports differ: they share this machine) with `spec.tenants` and `spec.coordination`
pointing at one real redis-server, in front of one real Tier-1 gateway (`igw serve`)
and its simulated pods. Open-loop load through both routers at once, several times
the limit, inside one minute window (the limiter's windows are minutes on Redis TIME):
the 200s over both routers add up to the limit within ±5 % (the Tier-1 model is
tests/test_tenant_limits_gateways.py). Then Redis is killed: the configured
`failureMode: closed` answers 503 `rate_limit_unavailable`, neither router crashes,
the routers' `igw_tenant_limits_*` series say so, and when Redis is back the limits are
shared again. Nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import signal

import httpx
import orjson
import pytest

from tests.procs import gateway, gateway_config, global_config, global_router, mint_key, sim_fleet
from tests.test_coordination_support import (
    assert_shared_limit,
    limited_body,
    limited_load,
    redis_server,
)
from tests.test_reliability_support import Load, picker_metrics, wait_for

MODEL = "llama-3.1-8b"
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(2)]
LIMIT = 120  # requests per minute, for the sum of both routers
RATE = 15.0  # requests/s per router: 600 offered over the run, 5x the limit
DURATION = 20.0


def _limits(router) -> dict:
    return httpx.get(router.status_url, timeout=5).json()["tenantLimits"]


def _metrics(router) -> dict[str, float]:
    """The router's /metrics, whose igw_tenant_limits_* series are Tier 1's."""
    return picker_metrics(router.config["spec"]["ports"]["metrics"])


def _replica_docs(tier1, keys_file, redis_url: str) -> list[dict]:
    """The same router config twice; only the listener and process ports differ."""
    spec = {
        "models": [{"name": MODEL, "policy": "fastest"}],
        "polling": {"interval": "100ms", "staleAfter": "1s"},
        "tenants": {"keysFile": str(keys_file), "failureMode": "closed",
                    "list": [{"name": "team-a", "limits": {"requestsPerMinute": LIMIT}}]},
        "coordination": {"url": redis_url, "heartbeatInterval": "250ms",
                         "replicaTimeout": "2s"},
    }
    region = {"name": "us-east-1", "endpoint": f"127.0.0.1:{tier1.ports['listen']}",
              "caFile": str(tier1.ca), "costs": {MODEL: {"perMillionTokens": 0.2}}}
    return [global_config([region], **spec) for _ in range(2)]


@pytest.mark.slow
def test_two_global_routers_admit_one_limit_within_5_percent_and_survive_redis(tmp_path):
    keys_file = tmp_path / "keys"
    key = mint_key(keys_file, "team-a")
    auth = {"authorization": f"Bearer {key}"}
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        fleet = stack.enter_context(sim_fleet(tmp_path, PODS, time_scale=20.0))
        schedulers = [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}]
        tier1 = stack.enter_context(gateway(tmp_path, gateway_config(schedulers)))
        routers = [stack.enter_context(global_router(tmp_path, doc))
                   for doc in _replica_docs(tier1, keys_file, redis.url)]
        wait_for(lambda: all(_limits(r)["replicas"] == 2 and _limits(r)["mode"] == "shared"
                             for r in routers), 20, "limits shared by both routers")
        wait_for(lambda: all(httpx.get(r.status_url, timeout=5).json()["regions"][0]["fresh"]
                             for r in routers), 20, "the region fresh in both routers")
        for router in routers:
            metrics = _metrics(router)
            assert metrics["igw_tenant_limits_shared"] == 1
            assert metrics["igw_tenant_limits_replicas"] == 2
        results = limited_load(routers, key, RATE, DURATION)
        sync_errors = sum(_limits(r)["sync_errors"] for r in routers)

        # Redis killed: failureMode closed refuses limited requests with a 503 naming it
        os.kill(redis.child.pid, signal.SIGKILL)
        redis.stop()  # reaps it
        wait_for(lambda: all(_limits(r)["redis"] == "down" for r in routers), 10,
                 "both routers to see Redis down")
        down = [Load(r.url, r.ca, rate=5.0, duration=3.0, body=limited_body, headers=auth,
                     keep_body=True).in_thread() for r in routers]
        down_results = [f.result(timeout=30) for f in down]
        assert all(r.proc.poll() is None for r in routers), "a router died with Redis"
        down_metrics = [_metrics(r) for r in routers]
        redis.start()  # same port: the sync's client reconnects
        wait_for(lambda: all(_limits(r)["mode"] == "shared" for r in routers), 20,
                 "limits shared again after Redis came back")

    unavailable = [o for r in down_results for o in r.outcomes]
    assert unavailable and all(o.status == 503 for o in unavailable), \
        [r.summary() for r in down_results]
    assert all(orjson.loads(o.body)["error"]["code"] == "rate_limit_unavailable"
               for o in unavailable)
    assert all(m["igw_tenant_limits_degraded"] == 1 for m in down_metrics)
    assert sum(m['igw_tenant_limits_refused_total{limit="unavailable"}']
               for m in down_metrics) == len(unavailable)
    fig = assert_shared_limit(results, LIMIT, "tenant_limit_two_global_routers_under_load",
                              "router")
    fig["sync_errors"] = sync_errors
    fig["redis_down_answers"] = len(unavailable)
    fig.emit()
