"""Reloading the GlobalRouterConfig (globalrouter.reload): what a reload may change, what
only a restart applies, and the parts adopting a reloaded config. The same through the
real `igw global serve`: tests/test_global_router.py (a region drained by editing the file)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from contract.global_config import parse_global_config
from globalrouter.director import GlobalDirector
from globalrouter.regions import RegionTable
from globalrouter.reload import GlobalConfigReloader, restart_only_changes

M = "llama"


def _doc() -> dict:
    return {"apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
            "metadata": {"name": "g"},
            "spec": {"regions": [
                {"name": "a", "endpoint": "127.0.0.2:1", "costs": {M: {"perMillionTokens": 1}}},
                {"name": "b", "endpoint": "127.0.0.3:1", "costs": {M: {"perMillionTokens": 2}}},
            ], "models": [{"name": M, "ttftSlo": "1s"}]}}


def _changed(mutate) -> list[str]:
    new = _doc()
    mutate(new["spec"])
    return restart_only_changes(parse_global_config(_doc()), parse_global_config(new))


@pytest.mark.parametrize("mutate", [
    lambda s: s["regions"][0].update(drain=True),
    lambda s: s["regions"][1]["costs"][M].update(perMillionTokens=0.5),
    lambda s: s["regions"][0].update(tags={"residency": "us"}),
    lambda s: s["models"][0].update(policy="fastest", ttftSlo="200ms"),
    lambda s: s.update(polling={"interval": "100ms", "staleAfter": "1s"}),
    lambda s: s.update(spillSaturation=0.8),
], ids=["drain", "cost", "tags", "policy", "polling", "spill"])
def test_what_the_router_alone_reads_reloads(mutate):
    assert _changed(mutate) == []


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda s: s["regions"][0].update(endpoint="127.0.0.9:1"), "spec.regions"),
    (lambda s: s["regions"].append({"name": "c", "endpoint": "127.0.0.4:1"}), "spec.regions"),
    (lambda s: s["regions"][0].update(serverName="other.test"), "spec.regions"),
    (lambda s: s.update(listener={"port": 9443}), "spec.listener"),
    (lambda s: s.update(maxRetries=1), "spec.maxRetries"),
    (lambda s: s.update(ports={"picker": 9100}), "spec.ports"),
    (lambda s: s.update(affinity={"maxSessions": 5}), "spec.affinity"),
    (lambda s: s.update(failureMode="open"), "spec.failureMode"),
], ids=["endpoint", "new region", "server name", "listener", "retries", "ports", "affinity",
        "failure mode"])
def test_what_envoy_or_the_setup_is_made_of_needs_a_restart(mutate, field):
    changed = _changed(mutate)
    assert len(changed) == 1 and changed[0].startswith(field), changed


def _summary() -> dict:
    return {"version": 1, "generation": 1, "serving": True, "pools": [
        {"model": M, "pods": 1, "readyPods": 1, "predictedTtftS": 0.1}]}


def test_a_reloaded_file_drains_reprices_and_refuses(tmp_path: Path):
    path = tmp_path / "global.yaml"
    path.write_text(yaml.safe_dump(_doc()))
    config = parse_global_config(_doc())
    table = RegionTable(config)
    director = GlobalDirector(config, table)
    for row in range(2):
        table.record_ok(row, _summary(), 0.01, time.monotonic())
    adopted = []

    def adopt(new):
        adopted.append(new)
        table.reconfigure(new)
        director.reconfigure(new)

    reloader = GlobalConfigReloader(config, path, adopt)
    doc = _doc()
    doc["spec"]["regions"][0]["drain"] = True
    doc["spec"]["regions"][1]["costs"][M]["perMillionTokens"] = 0.25
    path.write_text(yaml.safe_dump(doc))
    assert reloader.reload() and reloader.last == "applied"
    assert table.drained.tolist() == [True, False]
    assert np.allclose(table.views[M].cost, [1.0, 0.25])
    assert director.config is adopted[-1]
    broken = copy.deepcopy(doc)
    broken["spec"]["regions"][1]["endpoint"] = "nowhere"
    path.write_text(yaml.safe_dump(broken))
    assert not reloader.reload() and reloader.last.startswith("refused")
    path.write_text("spec: [")
    assert not reloader.reload()
    assert reloader.results == {"applied": 1, "refused": 2}
    assert reloader.config is adopted[-1] and len(adopted) == 1  # the running one stays
