"""Unit tests of the pieces the reliability suites rely on (no Envoy, no network).

CDS/RDS documents, the reload's union and restart-only checks, reading Envoy's
`/clusters`, passive-health marking, speed forgetting, the supervisor's restart
of a child whose start fails, and the picker's headers-phase answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from contract.config import parse_config
from igw.gateway import _stat_value
from igw.supervisor import ChildSpec, Supervisor
from igw_envoy.render import default_paths, render_bootstrap, write_bootstrap
from igw_envoy.xds import cds_path, rds_path, write_dynamic, written_versions
from picker.datalayer.speed import forget_weight
from picker.datastore import SPEED_STALE_S, Datastore, Pool
from picker.envoy_admin import ejected, parse_clusters
from picker.reload import restart_only_changes, union_config
from picker.scheduling.context import ScoringContext
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.state import STALE_RETRY_EVERY, PoolState


def doc(*schedulers: dict, **spec) -> dict:
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "u"},
        "spec": {"bbr": {"enabled": True}, "schedulers": list(schedulers), **spec},
    }


A = {"name": "a", "modelName": "m-a", "endpoints": ["127.0.0.1:8001"]}
B = {"name": "b", "modelName": "m-b", "endpoints": ["127.0.0.1:8002"]}


# --- CDS / RDS -----------------------------------------------------------------------------


def test_dynamic_files_hold_the_pools_and_version_by_content(tmp_path: Path):
    one = parse_config(doc(A))
    two = parse_config(doc(A, B))
    v1 = write_dynamic(one, tmp_path)
    assert written_versions(tmp_path) == v1
    clusters = json.loads(cds_path(tmp_path).read_text())
    assert [r["name"] for r in clusters["resources"]] == ["pool_a"]
    routes = json.loads(rds_path(tmp_path).read_text())["resources"][0]
    assert routes["name"] == "gateway"
    inode = cds_path(tmp_path).stat().st_ino
    assert write_dynamic(one, tmp_path) == v1
    assert cds_path(tmp_path).stat().st_ino == inode  # unchanged content: not rewritten
    v2 = write_dynamic(two, tmp_path)
    assert v2[0] != v1[0] and v2[1] != v1[1]
    names = [r["name"] for r in json.loads(cds_path(tmp_path).read_text())["resources"]]
    assert names == ["pool_a", "pool_b"]


def test_bootstrap_points_at_the_dynamic_files_and_inline_form_keeps_them(tmp_path: Path):
    config = parse_config(doc(A, B))
    path = write_bootstrap(config, tmp_path / "s")
    text = path.read_text()
    assert "cds/clusters.json" in text and "rds/routes.json" in text
    assert "pool_a" not in text  # the pool clusters live in the CDS file
    inline = render_bootstrap(config, default_paths(config, tmp_path / "s"))
    names = [c["name"] for c in inline["static_resources"]["clusters"]]
    assert names == ["picker", "picker_http", "pool_a", "pool_b"]  # picker_http: the load summary
    assert "dynamic_resources" not in inline


def test_envoy_restart_keeps_the_pickers_files(tmp_path: Path):
    state = tmp_path / "s"
    write_bootstrap(parse_config(doc(A)), state)
    write_dynamic(parse_config(doc(A, B)), state)  # what the picker wrote after a reload
    picker_versions = written_versions(state)
    write_bootstrap(parse_config(doc(A)), state, dynamic_files=False)
    assert written_versions(state) == picker_versions


# --- reload ----------------------------------------------------------------------------------


def test_union_config_adds_the_pools_only_the_old_config_has():
    old = parse_config(doc(A, B))
    new = parse_config(doc({**A, "routeTimeout": "10s"}))
    union = union_config(old, new)
    assert [s.name for s in union.schedulers] == ["a", "b"]
    assert union.schedulers[0].route_timeout_s == 10.0  # the new version of a kept pool


def test_restart_only_changes_name_the_fields():
    base = parse_config(doc(A))
    assert restart_only_changes(base, parse_config(doc(A, B))) == []
    assert restart_only_changes(base, parse_config(doc({**A, "weights": {"queue": 3}}))) == []
    moved = dataclasses.replace(base, listen_port=base.listen_port + 1, failure_mode="open")
    assert restart_only_changes(base, moved) == ["spec.listener", "spec.failureMode"]
    bigger = parse_config(doc(A, bbr={"enabled": True, "maxRequestBodyBytes": 4096}))
    assert restart_only_changes(base, bigger) == ["spec.bbr.maxRequestBodyBytes"]


# --- Envoy's /clusters and passive health ----------------------------------------------------

CLUSTERS = """\
picker::default_priority::max_connections::100000
picker::127.0.0.1:9002::health_flags::healthy
pool_a::added_via_api::true
pool_a::127.0.0.1:8001::cx_active::1
pool_a::127.0.0.1:8001::health_flags::/failed_outlier_check
pool_a::[::1]:8003::health_flags::healthy
pool_b::added_via_api::true
"""


def test_parse_clusters():
    hosts = parse_clusters(CLUSTERS)
    assert hosts["pool_a"] == {"127.0.0.1:8001": "/failed_outlier_check", "[::1]:8003": "healthy"}
    assert hosts["pool_b"] == {}
    assert ejected(hosts["pool_a"]["127.0.0.1:8001"])
    assert not ejected(hosts["pool_a"]["[::1]:8003"])


def test_ejected_pod_is_not_ready_until_released(tmp_path: Path):
    from picker.app import PickerApp

    config_path = tmp_path / "gw.yaml"
    config_path.write_text(
        json.dumps(doc({**A, "endpoints": ["127.0.0.1:8001", "127.0.0.1:8003"]}))
    )
    app = PickerApp(config_path, tmp_path / "state")
    pool = app.datastore.pools["a"]
    row = pool.pods["127.0.0.1:8001"].row
    app.outliers.apply(parse_clusters(CLUSTERS))
    assert not pool.table.ready[row]
    assert pool.table.ready[pool.pods["127.0.0.1:8003"].row]
    app.outliers.apply(parse_clusters(CLUSTERS.replace("/failed_outlier_check", "healthy")))
    assert pool.table.ready[row]


# --- speed forgetting ------------------------------------------------------------------------


def test_forget_weight():
    assert forget_weight(0) == 0.0
    assert forget_weight(-1) == 0.0
    assert forget_weight(SPEED_STALE_S / 2) == 0.0  # a short gap changes nothing
    assert forget_weight(SPEED_STALE_S + 0.1) == 1.0  # an expired estimate is replaced


def test_stale_learned_speed_is_replaced_by_the_pool_median():
    config = parse_config(doc({**A, "endpoints": ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]}))
    pool = Datastore(config).pools["a"]
    t = pool.table
    rows = [p.row for p in pool.pods.values()]
    t.prefill_tps[rows] = [10_000.0, 10_000.0, 1_000.0]  # the third was slow
    t.decode_step_s[rows] = [0.01, 0.01, 0.08]
    t.speed_seen_at[rows] = 100.0
    state = PoolState(pool)
    tps, step = state.speeds(now=101.0)
    assert tps[rows[2]] == 1_000.0 and step[rows[2]] == 0.08  # fresh: trusted
    state.invalidate_speeds()
    t.speed_seen_at[rows[:2]] = 100.0 + SPEED_STALE_S  # the others keep being observed
    tps, step = state.speeds(now=101.0 + SPEED_STALE_S)
    assert tps[rows[2]] == pytest.approx(10_000.0)  # stale: the pool median
    assert step[rows[2]] == pytest.approx(0.01)
    assert np.all(tps[rows[:2]] == 10_000.0)


def _stale_pool() -> tuple[Pool, PoolState, list[int], float]:
    """Three pods, the third slow and not observed for longer than `SPEED_STALE_S`."""
    config = parse_config(doc({**A, "endpoints": ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]}))
    pool = Datastore(config).pools["a"]
    t = pool.table
    rows = [p.row for p in pool.pods.values()]
    t.prefill_tps[rows] = [10_000.0, 10_000.0, 1_000.0]
    t.decode_step_s[rows] = [0.01, 0.01, 0.08]
    t.speed_seen_at[rows] = [100.0 + SPEED_STALE_S, 100.0 + SPEED_STALE_S, 100.0]
    state = PoolState(pool)
    return pool, state, rows, 101.0 + SPEED_STALE_S


def _candidate_speeds(pool: Pool, state: PoolState, rows: list[int], now: float,
                      prompt: int, adapter: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    request = SchedulingRequest(model="m-a", adapter=adapter, prompt_tokens=prompt)
    return ScoringContext(pool, state, request, np.array(rows), now).speeds()


def test_a_stale_pod_is_retried_at_the_median_once_per_budget_of_the_pools_requests():
    """A retry spends the pool's budget: until `STALE_RETRY_EVERY` more requests went out,
    every request sees the stale pod at the speed it last showed (so slow hardware the
    gateway rightly leaves alone costs a bounded share of requests, not one every few
    seconds); then one may retry it at the median again."""
    pool, state, rows, now = _stale_pool()
    tps, step = _candidate_speeds(pool, state, rows, now, prompt=2_000)
    assert tps[2] == pytest.approx(10_000.0) and step[2] == pytest.approx(0.01)  # a retry
    request = SchedulingRequest(model="m-a", prompt_tokens=200)
    state.on_dispatch(rows[2], request, now)
    for _ in range(STALE_RETRY_EVERY - 1):
        state.on_dispatch(rows[0], request, now)
    for prompt, adapter in ((200, None), (2_000, None), (200, "ad")):
        tps, step = _candidate_speeds(pool, state, rows, now, prompt, adapter)
        assert tps[2] == pytest.approx(1_000.0) and step[2] == pytest.approx(0.08)
        assert np.all(tps[:2] == pytest.approx(10_000.0))
    state.on_dispatch(rows[1], request, now)  # the budget's last: fresh pods count too
    tps, _ = _candidate_speeds(pool, state, rows, now, prompt=200)
    assert tps[2] == pytest.approx(10_000.0)


# --- supervisor ------------------------------------------------------------------------------


async def test_child_whose_restart_fails_is_retried(tmp_path: Path):
    marker = tmp_path / "runs"
    calls = {"n": 0}

    def flaky() -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first restart fails (e.g. an unreadable config)
            raise RuntimeError("render failed")

    script = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(0.2)"
    spec = ChildSpec("c", [sys.executable, "-c", script], before_start=flaky)
    sup = Supervisor([spec])
    await sup.start()
    try:
        for _ in range(100):
            if marker.exists() and len(marker.read_text()) >= 3:
                break
            await asyncio.sleep(0.05)
        assert len(marker.read_text()) >= 3  # still restarted after the failed start
        assert calls["n"] >= 4
    finally:
        await sup.stop()


async def test_before_stop_runs_before_the_signal():
    order: list[str] = []

    async def drain() -> None:
        order.append("drain")

    spec = ChildSpec("c", [sys.executable, "-c", "import time; time.sleep(30)"], before_stop=drain)
    sup = Supervisor([spec])
    await sup.start()
    await sup.stop()
    order.append("stopped")
    assert order == ["drain", "stopped"]
    assert sup.exit_codes()["c"] not in (None, 0)  # ended by the signal


def test_stat_value():
    text = "http.ingress_https.downstream_rq_active: 3\nother: 1\n"
    assert _stat_value(text, "http.ingress_https.downstream_rq_active") == 3
    assert _stat_value(text, "missing") is None


def test_picker_restart_with_a_broken_config_file_uses_the_last_good_one(tmp_path: Path):
    from contract.config import ConfigError
    from picker.app import PickerApp

    config_path = tmp_path / "gw.yaml"
    config_path.write_text(json.dumps(doc(A, B)))
    PickerApp(config_path, tmp_path / "state")  # a good start keeps a copy
    config_path.write_text("spec: [broken\n")
    app = PickerApp(config_path, tmp_path / "state")
    assert sorted(app.datastore.pools) == ["a", "b"]
    with pytest.raises(ConfigError):  # nothing good to fall back to: the error stands
        PickerApp(config_path, tmp_path / "other-state")


def test_picker_restart_refuses_a_listener_change_only_igw_serve_can_apply(tmp_path: Path):
    from picker.app import PickerApp

    config_path = tmp_path / "gw.yaml"
    config_path.write_text(json.dumps(doc(A)))
    first = PickerApp(config_path, tmp_path / "state").config
    config_path.write_text(json.dumps(doc(A, B, ports={"picker": 19_002})))
    again = PickerApp(config_path, tmp_path / "state").config
    assert again.picker_port == first.picker_port  # the running Envoy's picker port
    assert [s.name for s in again.schedulers] == ["a"]


# --- the picker's gRPC health -----------------------------------------------------------------


async def test_picker_health_is_one_status_on_the_ext_proc_and_admin_ports(tmp_path: Path):
    """Envoy probes the ext_proc port, Kubernetes the admin port: both must say the same."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from igw.ports import free_ports
    from picker.app import EXT_PROC_SERVICE, PickerApp

    picker, admin, metrics, envoy_admin = free_ports(4)
    ports = {"picker": picker, "admin": admin, "metrics": metrics, "envoyAdmin": envoy_admin}
    config_path = tmp_path / "gw.yaml"
    config_path.write_text(json.dumps(doc(A, ports=ports)))
    app = PickerApp(config_path, tmp_path / "state")
    services = ("", EXT_PROC_SERVICE, "no.such.Service")

    async def answers(port: int) -> dict[str, str]:
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in services:
                request = health_pb2.HealthCheckRequest(service=service)
                try:
                    reply = await stub.Check(request, timeout=5)
                except grpc.aio.AioRpcError as error:
                    out[service] = error.code().name
                else:
                    out[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return out

    await app.start()
    try:
        serving = dict(zip(services, ("SERVING", "SERVING", "NOT_FOUND"), strict=True))
        assert await answers(picker) == serving
        assert await answers(admin) == serving
        await app.stop_serving()  # what stop() does first, before the ports close
        draining = dict(zip(services, ("NOT_SERVING", "NOT_SERVING", "NOT_FOUND"), strict=True))
        assert await answers(picker) == draining
        assert await answers(admin) == draining
    finally:
        await app.stop(drain_timeout=0.1)
