"""The global router's director on its own (globalrouter.director): the answer it gives Envoy,
the errors it maps, and tenant identity and limits at the global tier (the Tier-1 limiter,
this replica alone; shared across two real router replicas: tests/test_global_tenant_limits.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from contract import headers as hdr
from contract.errors import ModelNotFound, NoEligibleRegion, Unauthorized
from contract.global_config import parse_global_config
from globalrouter.app import GlobalRouterApp
from globalrouter.director import GlobalDirector
from globalrouter.regions import RegionTable
from picker.director import RequestInfo
from picker.tenants.limits import Limiter, RateLimited
from tests.procs import global_config, mint_key

M = "llama"
BODY = orjson.dumps({"model": M, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4})


def _director(tmp_path: Path, tenants: dict | None = None) -> GlobalDirector:
    regions = [
        {"name": "a", "endpoint": "127.0.0.2:1", "costs": {M: {"perGpuHour": 4}}},
        {"name": "b", "endpoint": "127.0.0.3:1", "costs": {M: {"perGpuHour": 2}}},
    ]
    spec: dict = {"regions": regions, "models": [{"name": M, "ttftSlo": "1s"}], "maxRetries": 1}
    if tenants is not None:
        spec["tenants"] = tenants
    config = parse_global_config(
        {"apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
         "spec": spec})
    table = RegionTable(config)
    for row in range(len(table)):
        summary = {"version": 1, "generation": 1, "serving": True, "pools": [
            {"model": M, "adapters": [], "pods": 1, "readyPods": 1, "saturation": 0.0,
             "saturated": False, "predictedTtftS": 0.1}]}
        table.record_ok(row, summary, 0.01, time.monotonic())
    limiter = Limiter(failure_mode="open") if tenants is not None else None
    return GlobalDirector(config, table, limiter)


def _info(**kw) -> RequestInfo:
    return RequestInfo(path="/v1/chat/completions", content_type="application/json", **kw)


def test_the_answer_lists_the_regions_to_try_and_names_the_first(tmp_path: Path) -> None:
    director = _director(tmp_path)
    decision = director.route_now(BODY, _info())
    assert dict(decision.headers) == {
        hdr.DESTINATION_ENDPOINT: "127.0.0.3:1,127.0.0.2:1",  # cheaper first, then the retry
        hdr.REGION: "b",
    }
    assert decision.admission_wait is None
    director.complete(decision)
    assert director.placed["b"] == 1
    models = orjson.loads(director.models_body())
    assert [m["id"] for m in models["data"]] == [M]


def test_errors_are_counted_and_typed(tmp_path: Path) -> None:
    director = _director(tmp_path)
    with pytest.raises(ModelNotFound):
        director.route_now(BODY.replace(b'"llama"', b'"other"'), _info())
    with pytest.raises(NoEligibleRegion):
        director.route_now(BODY, _info(regions="c"))
    assert director.refused == {404: 1, 503: 1}


def test_tenants_are_identified_and_limited_at_the_global_tier(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    key = mint_key(keys, "acme")
    director = _director(tmp_path, {"keysFile": str(keys), "list": [
        {"name": "acme", "limits": {"requestsPerMinute": 2}}]})
    with pytest.raises(Unauthorized):
        director.route_now(BODY, _info())
    with pytest.raises(Unauthorized):
        director.route_now(BODY, _info(authorization="Bearer igw-nope"))
    auth = f"Bearer {key}"
    for _ in range(2):
        decision = director.route_now(BODY, _info(authorization=auth))
        assert decision.tenant is not None and decision.tenant.name == "acme"
        assert dict(decision.limit_headers)["x-ratelimit-limit-requests"] == "2"
        director.complete(decision)
    with pytest.raises(RateLimited) as refused:
        director.route_now(BODY, _info(authorization=auth))
    assert refused.value.status == 429


def test_a_session_is_recorded_where_it_was_placed_and_kept_there(tmp_path: Path) -> None:
    director = _director(tmp_path)
    first = director.route_now(BODY, _info(session="s1", regions="a"))
    assert first.region == "a"  # only a allowed: the session starts there
    again = director.route_now(BODY, _info(session="s1"))
    assert again.region == "a"  # b is cheaper, but the session stays
    assert director.route_now(BODY, _info()).region == "b"
    assert director.affine["session"] == 1 and director.affinity.sessions == 1


def test_the_http_port_may_face_the_pod_network_while_ext_proc_stays_local(
        tmp_path: Path) -> None:
    """`--metrics-host` (env IGW_METRICS_HOST): /metrics on another address than ext_proc."""
    doc = global_config([{"name": "a", "endpoint": "127.0.0.2:1"}])
    path = tmp_path / "global.yaml"
    path.write_text(yaml.safe_dump(doc))
    ports = doc["spec"]["ports"]

    async def run() -> tuple[int, bool]:
        app = GlobalRouterApp(path, host="127.0.0.1", metrics_host="127.0.0.7")
        await app.start()
        try:
            async with httpx.AsyncClient() as http:
                reply = await http.get(f"http://127.0.0.7:{ports['metrics']}/metrics")
            with socket.socket() as sock:  # ext_proc is not on the metrics address
                refused = sock.connect_ex(("127.0.0.7", ports["picker"])) != 0
            return reply.status_code, refused
        finally:
            await app.stop(drain_timeout=1.0)

    status, refused = asyncio.run(run())
    assert status == 200 and refused
