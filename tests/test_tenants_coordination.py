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
import time
from pathlib import Path

import httpx

from tests.header_pod import header_pod
from tests.procs import gateway, gateway_config, mint_key
from tests.test_coordination_support import redis_server
from tests.test_reliability_support import Figures, picker_metrics, wait_for

MODEL = "echo-model"
LIMIT = 10


def _post(gw, key: str) -> httpx.Response:
    ctx = ssl.create_default_context(cafile=str(gw.ca))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as http:
        return http.post("/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {key}"})


@contextlib.contextmanager
def two_gateways(tmp: Path, failure_mode: str):
    keys_file = tmp / "keys"
    key = mint_key(keys_file, "team-a")
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
        # never past the limit (each alone would admit 2 x LIMIT); near it the replicas split
        # what is left between them, so one may refuse while the other still has room
        assert LIMIT - 2 <= statuses.count(200) <= LIMIT, statuses
        fig = Figures("tenant_limit_two_gateways")
        fig["limit_per_minute"] = LIMIT
        fig["admitted_of_20"] = statuses.count(200)
        for g in gws:
            m = picker_metrics(g.ports["metrics"])
            assert m["igw_tenant_limits_shared"] == 1 and m["igw_tenant_limits_degraded"] == 0
        redis.stop()
        fig["degraded_after_s"] = wait_for(
            lambda: all(picker_metrics(g.ports["metrics"])["igw_tenant_limits_degraded"] == 1
                        for g in gws), 10, "limits degraded")
        # open: answered, never a 5xx; each gateway on its own share of the limit, whose
        # minute is spent (a sliding window: a request may fit again as the minute passes)
        answers = [_post(g, key) for g in gws for _ in range(3)]
        assert {a.status_code for a in answers} <= {200, 429}, [a.text for a in answers]
        refused = [a for a in answers if a.status_code == 429]
        assert len(refused) >= 4, [a.status_code for a in answers]
        assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
        fig["open_answers_after_redis_down"] = len(answers)
        fig.emit()


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
        fig = Figures("tenant_limits_fail_closed")
        fig["served_again_after_restart_s"] = wait_for(
            lambda: _post(gws[0], key).status_code == 200, 15, "served after Redis")
        fig.emit()
