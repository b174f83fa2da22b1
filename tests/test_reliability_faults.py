"""Faults under load through the real path: `igw serve` (Envoy + picker) in front of simulated pods.

Each test injects one fault while an open-loop load runs, and checks what the
clients saw: which requests failed (and that none failed that arrived after the
gateway noticed), how long noticing took, and that the pod (or process) comes
back. Measured figures are printed as `FIGURES ...` lines (pytest -s) and
quoted in RELIABILITY.md.

    pytest tests/test_reliability_faults.py -s
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import httpx
import pytest

from tests.procs import gateway, gateway_config, sim_fleet
from tests.test_reliability_support import (
    Figures,
    Load,
    chat_body,
    children,
    client_ssl,
    control,
    kill,
    pod_states,
    routable,
    wait_child,
    wait_for,
)

MODEL = "llama-3.1-8b"
OTHER_MODEL = "qwen3-32b"
PODS = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(3)]
TIME_SCALE = 2.0  # 8B on H100: ~4 ms per decode step of wall time


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    with sim_fleet(tmp, PODS, time_scale=TIME_SCALE) as fleet:
        config = gateway_config(
            [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}]
        )
        with gateway(tmp, config) as gw:
            yield fleet, gw


@pytest.fixture
def healthy(stack):
    """Every pod up, without faults and routable before and after the test."""
    fleet, gw = stack
    _restore(fleet, gw)
    yield fleet, gw
    _restore(fleet, gw)


def _restore(fleet, gw) -> None:
    for pod in fleet.pods:
        state = control(fleet.control_port, "GET", f"/pods/{pod['name']}/state")
        if not state["up"]:
            control(fleet.control_port, "POST", f"/pods/{pod['name']}/restart")
        elif any(v not in (False, None, 1.0, "ok", 0.0) for v in state["faults"].values()):
            control(fleet.control_port, "DELETE", f"/pods/{pod['name']}/faults")
    wait_for(
        lambda: all(routable(s) for s in pod_states(gw.admin, "pool").values()),
        timeout=20,
        what="every pod routable again",
    )


def _load(gw, rate: float, duration: float, max_tokens: int = 40, stream: bool = True) -> Load:
    return Load(
        gw.url,
        gw.ca,
        rate=rate,
        duration=duration,
        body=lambda i: chat_body(MODEL, f"request {i}", max_tokens, stream=stream),
        stream=stream,
    )


def _until_not_routable(gw, address: str, timeout: float) -> float:
    return wait_for(
        lambda: not routable(pod_states(gw.admin, "pool")[address]),
        timeout=timeout,
        what=f"{address} out of rotation",
        poll=0.01,
    )


def _until_routable(gw, address: str, timeout: float) -> float:
    return wait_for(
        lambda: routable(pod_states(gw.admin, "pool")[address]),
        timeout=timeout,
        what=f"{address} back in rotation",
        poll=0.02,
    )


# --- pods ------------------------------------------------------------------------------------


def test_pod_crash_mid_load(healthy):
    """In-flight streams on the crashed pod may fail; nothing sent after detection does;
    requests whose connection is refused are retried on the picker's next pod."""
    fleet, gw = healthy
    fig = Figures("pod_crash")
    victim = fleet.address("p1")
    load = _load(gw, rate=40, duration=10, max_tokens=60)
    future = load.in_thread()
    time.sleep(2.5)
    t_crash = time.monotonic()
    control(fleet.control_port, "POST", "/pods/p1/crash")
    t_dead = time.monotonic()  # the pod's listener and connections are gone from here on
    fig["detect_s"] = _until_not_routable(gw, victim, timeout=5) + (t_dead - t_crash)
    t_detect = t_crash + fig.values["detect_s"]
    time.sleep(2.0)
    t_restart = time.monotonic()
    control(fleet.control_port, "POST", "/pods/p1/restart")
    fig["back_after_restart_s"] = _until_routable(gw, victim, timeout=10)
    result = future.result(timeout=60)
    before = result.before(t_dead)
    window = [o for o in result.outcomes if t_dead <= o.sent < t_detect]
    after = result.after(t_detect)
    fig["requests"] = len(result.outcomes)
    fig["failed_in_flight_at_crash"] = len(result.failed(before))
    fig["sent_before_detection"] = len(window)
    fig["failed_before_detection"] = len(result.failed(window))
    fig["failed_after_detection"] = len(result.failed(after))
    fig["served_by_p1_after_restart"] = sum(
        1 for o in result.after(t_restart + fig.values["back_after_restart_s"]) if o.pod == "p1"
    )
    fig.emit()
    assert result.failed(after) == [], result.failed(after)[:3]
    assert len(result.failed(window)) == 0, result.failed(window)[:3]
    # only streams already running on p1 can fail
    assert len(result.failed(before)) <= 10
    assert fig.values["detect_s"] < 1.0


def test_pod_slow_gets_less_traffic_then_recovers(healthy):
    fleet, gw = healthy
    fig = Figures("pod_slow")
    control(fleet.control_port, "POST", "/pods/p0/faults", {"slowdown": 8})
    time.sleep(1.0)
    slow = _load(gw, rate=30, duration=6, max_tokens=40).in_thread().result(timeout=60)
    control(fleet.control_port, "DELETE", "/pods/p0/faults")
    time.sleep(1.0)
    normal = _load(gw, rate=30, duration=4, max_tokens=40).in_thread().result(timeout=60)
    share_slow = Counter(o.pod for o in slow.outcomes)["p0"] / len(slow.outcomes)
    share_normal = Counter(o.pod for o in normal.outcomes)["p0"] / len(normal.outcomes)
    fig["p0_share_while_slow"] = share_slow
    fig["p0_share_after"] = share_normal
    fig["failed"] = len(slow.failed()) + len(normal.failed())
    fig.emit()
    assert not slow.failed() and not normal.failed()
    assert share_slow < 0.15
    assert share_normal > 0.2


def test_pod_hang_is_taken_out_and_held_requests_finish(healthy):
    """A hung pod (inference and /metrics) leaves rotation once a scrape times out; the
    requests it holds finish when it recovers; nothing fails."""
    fleet, gw = healthy
    fig = Figures("pod_hang")
    victim = fleet.address("p2")
    load = _load(gw, rate=30, duration=7, max_tokens=30)
    future = load.in_thread()
    time.sleep(1.5)
    t_hang = time.monotonic()
    control(fleet.control_port, "POST", "/pods/p2/faults", {"hang": True})
    fig["detect_s"] = _until_not_routable(gw, victim, timeout=5)
    t_detect = t_hang + fig.values["detect_s"]
    time.sleep(2.5)
    control(fleet.control_port, "DELETE", "/pods/p2/faults")
    fig["back_s"] = _until_routable(gw, victim, timeout=10)
    result = future.result(timeout=60)
    held = [o for o in result.outcomes if o.pod == "p2" and t_hang <= o.sent < t_detect]
    fig["held_by_hung_pod"] = len(held)
    fig["sent_to_p2_after_detection"] = sum(
        1 for o in result.outcomes if o.pod == "p2" and t_detect + 0.1 < o.sent < t_detect + 2.4
    )
    fig["failed"] = len(result.failed())
    fig.emit()
    assert not result.failed(), result.failed()[:3]
    assert fig.values["sent_to_p2_after_detection"] == 0
    assert fig.values["detect_s"] < 1.5


@pytest.mark.parametrize("status", [500, 503])
def test_pod_answering_5xx_is_ejected_then_returns(healthy, status):
    """Envoy's outlier detection ejects the pod after 3 consecutive 5xx; the picker reads
    the ejection from Envoy's admin port and stops picking it. 503 (gateway error) is
    retried on the next pod, so clients see none; 500 is not retried (it may be the
    request that breaks an engine), so clients see the few before the ejection."""
    fleet, gw = healthy
    fig = Figures(f"pod_{status}")
    victim = fleet.address("p0")
    load = _load(gw, rate=30, duration=8, max_tokens=20, stream=False)
    future = load.in_thread()
    time.sleep(1.0)
    t_fault = time.monotonic()
    control(fleet.control_port, "POST", "/pods/p0/faults", {"error_status": status})
    fig["detect_s"] = _until_not_routable(gw, victim, timeout=5)
    t_detect = t_fault + fig.values["detect_s"]
    time.sleep(1.5)
    control(fleet.control_port, "DELETE", "/pods/p0/faults")
    fig["back_s"] = _until_routable(gw, victim, timeout=15)
    result = future.result(timeout=60)
    failed = result.failed()
    fig["client_errors"] = len(failed)
    fig["client_errors_after_detection"] = len(result.failed(result.after(t_detect + 0.05)))
    fig["statuses"] = dict(result.statuses())
    fig.emit()
    assert {o.status for o in failed} <= {status}
    if status == 503:
        assert failed == []
    else:
        # 3 consecutive 500s eject the pod in Envoy; until the picker's next poll of
        # Envoy's admin port (every 0.25 s) it may still pick it: ~3 more at this rate
        assert len(failed) <= 8
    assert result.failed(result.after(t_detect + 0.05)) == []


@pytest.mark.parametrize("mode", ["down", "garbled", "closed"])
def test_pod_metrics_broken_is_taken_out_then_returns(healthy, mode):
    fleet, gw = healthy
    fig = Figures(f"metrics_{mode}")
    victim = fleet.address("p1")
    load = _load(gw, rate=20, duration=5, max_tokens=10, stream=False)
    future = load.in_thread()
    time.sleep(0.5)
    t_fault = time.monotonic()
    control(fleet.control_port, "POST", "/pods/p1/faults", {"metrics": mode})
    fig["detect_s"] = _until_not_routable(gw, victim, timeout=5)
    t_detect = t_fault + fig.values["detect_s"]
    time.sleep(1.5)
    t_clear = time.monotonic()
    control(fleet.control_port, "DELETE", "/pods/p1/faults")
    fig["back_s"] = _until_routable(gw, victim, timeout=10)
    result = future.result(timeout=60)
    to_p1 = [o for o in result.outcomes if o.pod == "p1" and t_detect + 0.05 < o.sent < t_clear]
    fig["sent_to_p1_while_broken"] = len(to_p1)
    fig["failed"] = len(result.failed())
    fig.emit()
    assert not result.failed()
    assert to_p1 == []


# --- processes -------------------------------------------------------------------------------


def _first_ok_after(gw, t0: float, timeout: float) -> float:
    """Seconds from `t0` until a request is routed by the picker again (200)."""
    with httpx.Client(base_url=gw.url, verify=client_ssl(gw.ca), timeout=5) as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = c.post(
                    "/v1/chat/completions",
                    content=chat_body(MODEL, "probe", 2),
                    headers={"content-type": "application/json"},
                )
                if r.status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise AssertionError("no successful request after the restart")


def test_picker_killed_fail_closed_is_fast_503_and_restarts(healthy):
    _, gw = healthy
    fig = Figures("picker_killed_closed")
    picker = children(gw.proc.pid)["picker"]
    load = _load(gw, rate=30, duration=6, max_tokens=10, stream=False)
    future = load.in_thread()
    time.sleep(1.0)
    t_kill = time.monotonic()
    kill(picker)
    new = wait_child(gw.proc.pid, "picker", timeout=5, not_pid=picker)
    fig["picks_back_s"] = _first_ok_after(gw, t_kill, timeout=10)
    result = future.result(timeout=60)
    failed = result.failed()
    fig["failed"] = len(failed)
    fig["failed_statuses"] = dict(result.statuses(failed))
    fig["max_failed_latency_ms"] = max((o.latency for o in failed), default=0) * 1000
    fig.emit()
    assert new != picker
    assert fig.values["picks_back_s"] < 2.0
    for o in failed:
        assert o.status == 503, o
        assert o.retry_after is not None
        assert o.content_type.startswith("application/json")
        assert o.latency < 1.0
    assert all(o.ok for o in result.after(t_kill + fig.values["picks_back_s"] + 0.05))


def test_envoy_killed_is_restarted(healthy):
    _, gw = healthy
    fig = Figures("envoy_killed")
    envoy = children(gw.proc.pid)["envoy"]
    load = _load(gw, rate=20, duration=6, max_tokens=10, stream=False)
    future = load.in_thread()
    time.sleep(1.0)
    t_kill = time.monotonic()
    kill(envoy)
    new = wait_child(gw.proc.pid, "envoy", timeout=5, not_pid=envoy)
    fig["serving_again_s"] = _first_ok_after(gw, t_kill, timeout=15)
    result = future.result(timeout=60)
    fig["failed"] = len(result.failed())
    fig["failed_kinds"] = dict(Counter(o.error.split(":")[0] or o.status for o in result.failed()))
    fig.emit()
    assert new != envoy
    assert fig.values["serving_again_s"] < 3.0
    assert all(o.ok for o in result.after(t_kill + fig.values["serving_again_s"] + 0.1))


@pytest.mark.parametrize("pools", [1, 2])
def test_picker_killed_fail_open_keeps_serving_through_pool_members(tmp_path, pools):
    """One pool: Envoy's own balancing over its members. Two pools (one model each):
    Envoy finds the pool from the body's model itself (the Lua fallback), so every
    request still reaches a pod of its own model (the other would answer 404)."""
    models = [MODEL, OTHER_MODEL][:pools]
    pods = [{**PODS[0], "model": models[0]}, {**PODS[1], "model": models[-1]}]
    with sim_fleet(tmp_path, pods, time_scale=TIME_SCALE) as fleet:
        addresses = fleet.addresses()
        schedulers = (
            [{"name": "pool", "modelName": MODEL, "endpoints": addresses}] if pools == 1 else
            [{"name": f"pool{i}", "modelName": m, "endpoints": [addresses[i]]}
             for i, m in enumerate(models)]
        )
        config = gateway_config(schedulers, failureMode="open")
        with gateway(tmp_path, config) as gw:
            fig = Figures(f"picker_killed_open_{pools}_pools")
            picker = children(gw.proc.pid)["picker"]
            load = Load(
                gw.url,
                gw.ca,
                rate=30,
                duration=5,
                body=lambda i: chat_body(models[i % pools], f"r{i}", 10),
                # a forged destination must not matter, picker or not
                headers={"x-gateway-destination-endpoint": f"127.0.0.1:{gw.ports['envoyAdmin']}"},
            )
            future = load.in_thread()
            time.sleep(1.0)
            t_kill = time.monotonic()
            kill(picker)
            wait_child(gw.proc.pid, "picker", timeout=5, not_pid=picker)
            result = future.result(timeout=60)
            during = [o for o in result.outcomes if t_kill <= o.sent < t_kill + 1.0]
            fig["requests"] = len(result.outcomes)
            fig["sent_while_picker_down"] = len(during)
            fig["failed"] = len(result.failed())
            fig["served_by"] = dict(Counter(o.pod for o in result.outcomes))
            fig.emit()
            assert not result.failed(), result.failed()[:3]
            assert {o.pod for o in result.outcomes} <= {"p0", "p1"}
            if pools == 2:
                assert all(o.pod == f"p{o.index % 2}" for o in result.outcomes)
                assert len(during) > 0


@pytest.mark.parametrize("drain_timeout", [20.0, 0.5])
def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path, drain_timeout):
    """SIGTERM to `igw serve`: new connections are refused at once, streams already
    running finish (up to the drain timeout, then they are cut), then it exits 0."""
    with sim_fleet(tmp_path, PODS[:1], time_scale=1.0) as fleet:
        config = gateway_config(
            [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}]
        )
        args = ("--drain-timeout", f"{drain_timeout:g}")
        with gateway(tmp_path, config, extra_args=args) as gw:
            fig = Figures(f"graceful_shutdown_drain_{drain_timeout:g}s")
            # ~250 tokens × ~8.5 ms per step: each stream runs ~2 s
            load = Load(
                gw.url,
                gw.ca,
                rate=20,
                duration=0.25,
                body=lambda i: chat_body(MODEL, f"long {i}", 250, stream=True),
                stream=True,
            )
            future = load.in_thread()
            time.sleep(0.6)
            t_term = time.monotonic()
            os.kill(gw.proc.pid, signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.ConnectError), httpx.Client(verify=client_ssl(gw.ca)) as c:
                c.get(f"{gw.url}/healthz", timeout=2)
            code = gw.proc.wait(timeout=30)
            fig["exit_after_s"] = time.monotonic() - t_term
            result = future.result(timeout=30)
            fig["streams"] = len(result.outcomes)
            fig["completed"] = sum(1 for o in result.outcomes if o.ok)
            fig["last_stream_end_after_term_s"] = max(o.done for o in result.outcomes) - t_term
            fig.emit()
            assert code == 0
            assert len(result.outcomes) == 5
            if drain_timeout > 5:
                assert all(o.ok for o in result.outcomes), [o.error for o in result.outcomes]
                assert fig.values["last_stream_end_after_term_s"] > 0.5  # really in flight
            else:
                assert fig.values["exit_after_s"] < drain_timeout + 1.5
                assert not any(o.ok for o in result.outcomes)  # cut at the drain timeout
