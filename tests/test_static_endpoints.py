"""Static endpoints given as names: the picker's choice must still be what Envoy serves."""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter

import httpx

from contract.config import GatewayConfig, SchedulerConfig
from igw.admin_client import list_pools
from picker.datastore import Datastore
from picker.discovery import static
from picker.discovery.static import StaticResolver, has_names
from tests.procs import gateway, gateway_config, sim_fleet


def test_named_endpoints_route_to_the_picked_pod(tmp_path):
    pods = [{"name": f"p{i}", "gpu": "h100", "model": "m-8b", "engine": "vllm"} for i in range(3)]
    with sim_fleet(tmp_path, pods) as fleet:
        named = [f"localhost:{p['port']}" for p in fleet.pods]
        config = gateway_config([{"name": "m", "modelName": "m-8b", "endpoints": named,
                                  "scheduler": "least-request"}])
        with gateway(tmp_path, config) as gw:
            ctx = ssl.create_default_context(cafile=str(gw.ca))
            served: Counter[str] = Counter()
            with httpx.Client(base_url=gw.url, verify=ctx, timeout=30) as c:
                for i in range(15):
                    r = c.post("/v1/completions",
                               json={"model": "m-8b", "prompt": f"x{i}", "max_tokens": 1})
                    assert r.status_code == 200
                    served[r.headers["x-sim-pod"]] += 1
            state = list_pools(gw.admin)[0]["pods"]
            picked = Counter({fleet.name_of(p["address"]): int(p.get("picks", 0)) for p in state})
            assert +picked == served
            assert {p["name"] for p in state} == set(named)


def test_has_names():
    assert not has_names(("127.0.0.1:1", "[::1]:2"))
    assert has_names(("127.0.0.1:1", "pod-a:8000"))


def test_resolver_follows_a_name_that_moves(monkeypatch):
    answers = {"pod-a:8000": ["10.0.0.1:8000"]}

    def fake_resolve(endpoints):
        return [(ip, e) for e in endpoints for ip in answers[e]]

    monkeypatch.setattr(static, "resolve_endpoints", fake_resolve)
    monkeypatch.setattr("picker.datastore.resolve_endpoints", fake_resolve)
    config = GatewayConfig(name="t", schedulers=(
        SchedulerConfig(name="p", model_name="m", endpoints=("pod-a:8000",)),))
    datastore = Datastore(config)
    pool = datastore.pools["p"]
    assert pool.members() == ["10.0.0.1:8000"]
    assert pool.pods["10.0.0.1:8000"].name == "pod-a:8000"
    changed: list[str] = []
    resolver = StaticResolver(datastore, changed.append)
    asyncio.run(resolver.resolve_once())
    assert changed == []
    answers["pod-a:8000"] = ["10.0.0.9:8000"]
    asyncio.run(resolver.resolve_once())
    assert changed == ["p"] and pool.members() == ["10.0.0.9:8000"]
    answers["pod-a:8000"] = []
    asyncio.run(resolver.resolve_once())
    assert pool.members() == ["10.0.0.9:8000"]  # resolution lost: keep the last members
