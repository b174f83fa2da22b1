"""One tenant limit, two real gateways, concurrent load: the total holds within ±5 %.

Two `igw serve` (Envoy + picker each) sharing one real redis-server, in front of the
simulator's pods; one tenant with `requestsPerMinute`; open-loop load through both
gateways at once, several times the limit. The load runs inside one minute window
(the limiter's windows are minutes on the shared clock, Redis TIME, which is this
machine's wall clock), so the whole run may admit exactly the limit: the test waits
for a window with enough time left. Every answer is a 200 or a 429 with OpenAI's body
and headers; the sum of the 200s over both gateways is the limit within ±5 %.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.procs import gateway, gateway_config, mint_key, sim_fleet
from tests.test_coordination_support import assert_shared_limit, limited_load, redis_server
from tests.test_reliability_support import picker_metrics, wait_for

MODEL = "llama-3.1-8b"
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(2)]
LIMIT = 120  # requests per minute, for the sum of both gateways
RATE = 15.0  # requests/s per gateway: 1,200 offered over the run, 10x the limit
DURATION = 40.0


@pytest.mark.slow
def test_two_gateways_under_load_admit_the_limit_within_5_percent(tmp_path):
    keys_file = tmp_path / "keys"
    key = mint_key(keys_file, "team-a")
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        fleet = stack.enter_context(sim_fleet(tmp_path, PODS, time_scale=20.0))
        coordination = {"url": redis.url, "heartbeatInterval": "250ms", "replicaTimeout": "2s"}
        tenants = {"keysFile": str(keys_file),
                   "list": [{"name": "team-a", "limits": {"requestsPerMinute": LIMIT}}]}
        schedulers = [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}]
        gws = [stack.enter_context(gateway(tmp_path, gateway_config(
            schedulers, coordination=coordination, tenants=tenants))) for _ in range(2)]
        wait_for(lambda: all(picker_metrics(g.ports["metrics"]).get(
            "igw_tenant_limits_replicas") == 2 for g in gws), 20, "limits shared")
        results = limited_load(gws, key, RATE, DURATION)
        sync_errors = sum(picker_metrics(g.ports["metrics"]).get(
            "igw_tenant_limits_sync_errors_total", 0) for g in gws)
    fig = assert_shared_limit(results, LIMIT, "tenant_limit_two_gateways_under_load",
                              "gateway", overload=5)
    fig["sync_errors"] = sync_errors
    fig.emit()
