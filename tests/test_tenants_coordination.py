"""Tenant limits across two real gateways (`igw serve`) sharing one real redis-server.

What the picker app wires: the limiter syncs through the coordination Redis (the
same URL, prefix and replica id), so a limit holds for the sum of both gateways;
with Redis killed, failureMode decides (open: each gateway its share, answered
200/429; closed: 503 rate_limit_unavailable), visible in the metrics. The
limiter's own arithmetic is tests/test_tenant_limits*.py.
"""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.header_pod import header_pod
from tests.procs import gateway, gateway_config
from tests.test_coordination_support import redis_server
from tests.test_reliability_support import picker_metrics, wait_for

MODEL = "echo-model"
LIMIT = 10


def _key(keys_file: Path, tenant: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "igw.cli", "tenants", "add-key", tenant, "--keys-file",
         str(keys_file)], capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def _post(gw, key: str) -> httpx.Response:
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as http:
        return http.post("/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {key}"})


@contextlib.contextmanager
def two_gateways(tmp: Path, failure_mode: str):
    keys_file = tmp / "keys"
    key = _key(keys_file, "team-a")
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_server())
        pod = stack.enter_context(header_pod())
        coordination = {"url": redis.url, "heartbeatInterval": "250ms", "replicaTimeout": "2s"}
        tenants = {"keysFile": str(keys_file), "failureMode": failure_mode,
                   "list": [{"name": "team-a", "limits": {"requestsPerMinute": LIMIT}}]}
        schedulers = [{"name": "echo", "modelName": MODEL, "endpoints": [pod.address]}]
        gws = [
            stack.enter_context(gateway(tmp, gateway_config(
                schedulers, coordination=coordination, tenants=tenants)))
            for _ in range(2)
        ]

        def shared() -> bool:
            return all(
                picker_metrics(g.ports["metrics"]).get("igw_tenant_limits_replicas") == 2
                for g in gws
            )

        wait_for(shared, 20, "both gateways share the limits")
        yield redis, gws, key


def test_one_limit_holds_for_both_gateways_and_redis_down_fails_open(tmp_path):
    with two_gateways(tmp_path, "open") as (redis, gws, key):
        statuses = []
        for i in range(2 * LIMIT):
            statuses.append(_post(gws[i % 2], key).status_code)
            time.sleep(0.15)  # longer than a sync: each sees the other's admissions
        assert set(statuses) <= {200, 429}
        assert statuses.count(200) == LIMIT, statuses
        for g in gws:
            m = picker_metrics(g.ports["metrics"])
            assert m["igw_tenant_limits_shared"] == 1 and m["igw_tenant_limits_degraded"] == 0
        redis.stop()
        wait_for(lambda: all(picker_metrics(g.ports["metrics"])["igw_tenant_limits_degraded"]
                             == 1 for g in gws), 10, "limits degraded")
        # open: answered (refused here, the minute's budget is spent), never a 5xx
        answers = [_post(g, key) for g in gws for _ in range(3)]
        assert {a.status_code for a in answers} == {429}, [a.text for a in answers]
        assert answers[0].json()["error"]["code"] == "rate_limit_exceeded"


def test_redis_down_fails_closed_with_a_503(tmp_path):
    with two_gateways(tmp_path, "closed") as (redis, gws, key):
        assert _post(gws[0], key).status_code == 200
        redis.stop()
        wait_for(lambda: picker_metrics(gws[0].ports["metrics"])["igw_tenant_limits_degraded"]
                 == 1, 10, "limits degraded")
        refused = _post(gws[0], key)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_unavailable"
        assert int(refused.headers["retry-after"]) >= 1
        m = picker_metrics(gws[0].ports["metrics"])
        assert m['igw_tenant_limits_refused_total{limit="unavailable"}'] >= 1
        redis.start()  # back: served again once the limits resync
        wait_for(lambda: _post(gws[0], key).status_code == 200, 15, "served after Redis")
