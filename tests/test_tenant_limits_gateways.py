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
import time

import orjson
import pytest

from tests.procs import gateway, gateway_config, mint_key, sim_fleet
from tests.test_coordination_support import redis_server
from tests.test_reliability_support import Figures, Load, picker_metrics, wait_for

MODEL = "llama-3.1-8b"
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(2)]
LIMIT = 120  # requests per minute, for the sum of both gateways
RATE = 15.0  # requests/s per gateway: 1,200 offered over the run, 10x the limit
DURATION = 40.0
WINDOW_S = 60.0


def _body(i: int) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 4,
                         "messages": [{"role": "user", "content": f"question {i}"}]})


def _wait_for_window(needed_s: float) -> None:
    """Until the current minute (wall clock) has `needed_s` left."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < needed_s:
        time.sleep(left + 0.5)


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
        _wait_for_window(DURATION + 8)
        window = int(time.time() // WINDOW_S)
        loads = [Load(g.url, g.ca, rate=RATE, duration=DURATION, body=_body,
                      headers={"authorization": f"Bearer {key}"}, timeout=20).in_thread()
                 for g in gws]
        results = [f.result(timeout=DURATION + 60) for f in loads]
        assert int(time.time() // WINDOW_S) == window, "the run left its window"
        sync_errors = sum(picker_metrics(g.ports["metrics"]).get(
            "igw_tenant_limits_sync_errors_total", 0) for g in gws)
    statuses = [r.statuses() for r in results]
    admitted = sum(s[200] for s in statuses)
    assert all(set(s) <= {200, 429} for s in statuses), [r.summary() for r in results]
    assert sum(s[429] for s in statuses) > 5 * LIMIT  # the load really was over the limit
    assert abs(admitted - LIMIT) <= 0.05 * LIMIT, (admitted, [r.summary() for r in results])
    refused = [o for r in results for o in r.outcomes if o.status == 429]
    assert all(o.retry_after and int(o.retry_after) >= 1 for o in refused)
    # both gateways served part of it (the limit is one, not one each)
    assert all(s[200] > 0 for s in statuses), statuses
    fig = Figures("tenant_limit_two_gateways_under_load")
    fig["limit_per_minute"] = LIMIT
    fig["offered"] = sum(len(r.outcomes) for r in results)
    fig["admitted"] = admitted
    fig["admitted_per_gateway"] = [s[200] for s in statuses]
    fig["error_vs_limit_pct"] = round(100 * (admitted - LIMIT) / LIMIT, 2)
    fig["sync_errors"] = sync_errors
    fig.emit()
