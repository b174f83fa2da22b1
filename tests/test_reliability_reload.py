"""Config reload under load, through the real path (`igw serve`: Envoy + picker, simulated pods).

A valid change (new weights, a pod added, a new model = new Envoy cluster and
route, a model removed) applies while requests flow, and not one of them
fails; an invalid change is refused with an error that names the field, and
the running config keeps serving.

    pytest tests/test_reliability_reload.py -s     # prints the measured figures
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from igw_envoy.xds import cds_path, rds_path
from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import (
    Figures,
    Load,
    chat_body,
    children,
    client_ssl,
    kill,
    picker_metrics,
)

A, B = "model-a", "model-b"
PODS = [
    {"name": "a0", "gpu": "h100", "model": A},
    {"name": "a1", "gpu": "h100", "model": A},
    {"name": "a2", "gpu": "h100", "model": A},
    {"name": "b0", "gpu": "h100", "model": B},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reload")
    with sim_fleet(tmp, PODS, time_scale=20.0) as fleet:
        config = gateway_config(
            [
                {
                    "name": "a",
                    "modelName": A,
                    "endpoints": [fleet.address("a0"), fleet.address("a1")],
                }
            ],
            bbr={"enabled": True},
        )
        with gateway(tmp, config) as gw:
            yield fleet, gw


def write_config(path: Path, doc: dict) -> None:
    """Replace the file by rename, as a Kubernetes ConfigMap mount or an editor does."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gw-", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(doc, fh)
    os.replace(tmp, path)


def reloads(gw, result: str) -> float:
    return picker_metrics(gw.ports["metrics"]).get(
        f'igw_config_reloads_total{{result="{result}"}}', 0
    )


async def _until_served(gw, model: str, timeout: float) -> float:
    """Seconds until a request for `model` is answered 200 (polled every 50 ms)."""
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.url, verify=client_ssl(gw.ca), timeout=10) as c:
        while time.monotonic() - start < timeout:
            try:
                r = await c.post("/v1/chat/completions", content=chat_body(model, "probe", 2))
                if r.status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass  # Envoy restarting
            await asyncio.sleep(0.05)
    raise AssertionError(f"{model} not served within {timeout}s")


async def test_valid_reloads_under_load_lose_no_request(stack):
    fleet, gw = stack
    fig = Figures("reload_under_load")
    doc = copy.deepcopy(gw.config)
    load = Load(
        gw.url,
        gw.ca,
        rate=40,
        duration=14,
        body=lambda i: chat_body(A, f"request {i}", 12, stream=i % 2 == 0),
        stream=False,
    )
    streamed = Load(
        gw.url,
        gw.ca,
        rate=10,
        duration=14,
        body=lambda i: chat_body(A, f"stream {i}", 40, stream=True),
        stream=True,
    )
    runs = asyncio.gather(load.run(), streamed.run())
    applied_before = reloads(gw, "applied")
    await asyncio.sleep(1.0)

    # 1. new weights
    doc["spec"]["schedulers"][0]["weights"] = {"queue": 5, "kvCache": 1}
    write_config(gw.config_path, doc)
    await asyncio.sleep(2.0)

    # 2. a pod added to the pool
    t_pod = time.monotonic()
    doc["spec"]["schedulers"][0]["endpoints"].append(fleet.address("a2"))
    write_config(gw.config_path, doc)
    await asyncio.sleep(2.5)

    # 3. a new model: a new Envoy cluster and route, without restarting Envoy
    envoy = children(gw.proc.pid)["envoy"]
    files = (cds_path(gw.state_dir).stat().st_ino, rds_path(gw.state_dir).stat().st_ino)
    doc["spec"]["schedulers"].append(
        {"name": "b", "modelName": B, "endpoints": [fleet.address("b0")]}
    )
    t_model = time.monotonic()
    write_config(gw.config_path, doc)
    await _until_served(gw, B, timeout=10)
    fig["new_model_served_after_s"] = time.monotonic() - t_model
    assert (cds_path(gw.state_dir).stat().st_ino, rds_path(gw.state_dir).stat().st_ino) != files
    assert children(gw.proc.pid)["envoy"] == envoy  # same Envoy process
    await asyncio.sleep(1.0)

    # 4. a model removed
    doc["spec"]["schedulers"].pop()
    write_config(gw.config_path, doc)
    await asyncio.sleep(2.5)
    async with httpx.AsyncClient(base_url=gw.url, verify=client_ssl(gw.ca), timeout=10) as c:
        r = await c.post("/v1/chat/completions", content=chat_body(B, "gone", 2))
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"

    result, streams = await runs
    fig["requests"] = len(result.outcomes) + len(streams.outcomes)
    fig["failed"] = len(result.failed()) + len(streams.failed())
    fig["applied"] = reloads(gw, "applied") - applied_before
    a2 = sum(1 for o in result.outcomes if o.pod == "a2" and o.sent > t_pod)
    fig["served_by_added_pod"] = a2
    fig.emit()
    assert not result.failed(), result.failed()[:3]
    assert not streams.failed(), streams.failed()[:3]
    assert result.skipped == 0 and streams.skipped == 0
    assert a2 > 0  # the added pod took traffic
    assert fig.values["applied"] == 4


async def test_invalid_change_is_refused_and_the_running_config_stays(stack):
    _, gw = stack
    good = yaml.safe_load(gw.config_path.read_text())
    refused_before = reloads(gw, "refused")
    cases = {
        "unknown field": ("spec.schedulers[0].wieghts", _with(good, "wieghts", {"queue": 1})),
        "bad value": ("spec.schedulers[0].scheduler", _with(good, "scheduler", "fastest")),
        "listener change": ("spec.listener", _listener_moved(good)),
    }
    load = Load(
        gw.url,
        gw.ca,
        rate=20,
        duration=2.5 * len(cases) + 1,
        body=lambda i: chat_body(A, f"r{i}", 6),
    )
    run = asyncio.create_task(load.run())
    for expected, (field, bad) in cases.items():
        write_config(gw.config_path, bad)
        deadline = time.monotonic() + 5
        while reloads(gw, "refused") == refused_before and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert reloads(gw, "refused") == refused_before + 1, expected
        status = json.loads((gw.state_dir / "reload-status.json").read_text())
        assert status["result"] == "refused"
        assert field in status["message"], status
        print(f"\nrefused ({expected}): {status['message']}")
        refused_before += 1
        await asyncio.sleep(0.5)
    # not-YAML at all
    gw.config_path.write_text("spec: [unclosed\n")
    deadline = time.monotonic() + 5
    while reloads(gw, "refused") == refused_before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert reloads(gw, "refused") == refused_before + 1
    result = await run
    assert not result.failed(), result.failed()[:3]
    print(f"\nFIGURES reload_refused: {result.summary()}")

    # the picker and Envoy crash while the file is broken: both come back on the
    # last good config instead of failing to start
    pids = children(gw.proc.pid)
    for role in ("picker", "envoy"):
        kill(pids[role])
    back = await _until_served(gw, A, timeout=15)
    write_config(gw.config_path, good)
    new = children(gw.proc.pid)
    assert new["picker"] != pids["picker"] and new["envoy"] != pids["envoy"]
    print(f"\nFIGURES restart_with_broken_config: serving_again_s={back:.3f}")


def _with(doc: dict, key: str, value: object) -> dict:
    bad = copy.deepcopy(doc)
    bad["spec"]["schedulers"][0][key] = value
    return bad


def _listener_moved(doc: dict) -> dict:
    bad = copy.deepcopy(doc)
    bad["spec"]["listener"]["port"] = bad["spec"]["listener"]["port"] + 1
    return bad
