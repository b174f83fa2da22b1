"""The global-overhead benchmark's own parts: the paced wrk script offers the rate it is
given (against the real echo server, with real wrk), and the summary judges a point the
way #18's bound reads (the global tier's p50 and CPU both within Tier 1's own), for each
tier in front of a backend that costs nothing and for the stacked path.

Speed is what `python -m bench.global_overhead` measures; here only that the offered rate
is the configured one (a pacing bug would make the paced points compare unequal loads).
"""

from __future__ import annotations

import shutil
import sys

import pytest

from bench.global_overhead import Spec, _scripts, _summary, render
from bench.overhead import _wrk
from bench.procs import start_child, wait_log_line
from igw.ports import free_ports


def test_paced_scripts_split_the_rate_over_wrk_threads(tmp_path):
    scripts = _scripts(tmp_path)
    closed = scripts[Spec(1)].read_text()
    assert "function delay" not in closed
    one = scripts[Spec(1, 200)].read_text()
    eight = scripts[Spec(8, 400)].read_text()
    assert "local period_ms = 1000 / 200\n" in one
    # two wrk threads at 8 connections, each with its own schedule: 200/s each
    assert "local period_ms = 1000 / 200\n" in eight
    assert Spec(8, 400).label == "8 at 400/s" and Spec(8).label == "8 closed"


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (.ci/system-deps)")
@pytest.mark.parametrize("spec", [Spec(1, 200), Spec(8, 400)], ids=lambda s: s.label)
def test_a_paced_point_offers_its_rate(tmp_path, spec):
    """Whatever the latency, the sends follow the schedule: a closed loop against the
    echo server would send thousands a second."""
    (port,) = free_ports(1)
    echo = start_child("echo", [sys.executable, "-m", "bench.echo_server", "--port",
                                str(port)], tmp_path / "echo.log")
    try:
        wait_log_line(echo, lambda line: line.startswith("echo ready"), 20)
        out = _wrk(f"http://127.0.0.1:{port}/v1/chat/completions", _scripts(tmp_path)[spec],
                   spec.connections, 2.0)
    finally:
        echo.stop()
    assert out["errors"] == 0 and out["status_errors"] == 0
    rate = out["requests"] / (out["duration_us"] / 1e6)
    assert 0.85 * spec.rate <= rate <= 1.1 * spec.rate


def _point(path: str, p50_ms: float, cpu: dict[str, float]) -> dict:
    return {"path": path, "connections": 1, "rate": 200, "requests": 400, "errors": 0,
            "p50_us": p50_ms * 1000, "p99_us": p50_ms * 2000, "rps": 200.0,
            "cpu_ms_per_request": cpu}


def test_a_point_is_within_only_when_p50_and_cpu_both_are():
    spec = Spec(1, 200)
    tier1 = {"tier1-picker": 0.4, "tier1-envoy": 0.5}
    front = {"global-globalrouter": 0.3, "global-envoy": 0.4}
    points = [
        _point("echo", 0.2, {"echo": 0.01}),
        _point("tier1", 1.2, {**tier1, "echo": 0.05}),  # Tier 1's own: 1.0 ms, 0.9 ms CPU
        _point("global", 2.1, {**tier1, "global-globalrouter": 0.3, "global-envoy": 0.5,
                               "echo": 0.05}),
        _point("standin", 0.3, {"standin": 0.02}),
        # the global tier's own: 0.9 ms, 0.7 ms CPU (the stand-in's is the region's)
        _point("global-standin", 1.2, {**front, "standin": 0.1}),
    ]
    row = _summary(points, spec)
    assert row["own_p50_ms"] == pytest.approx(0.9)
    assert row["own_cpu_ms"] == pytest.approx(0.7)
    assert row["added_p50_ms"] == pytest.approx(0.9)
    assert row["tier1_p50_ms"] == pytest.approx(1.0)
    # neither the Tier-1 processes' CPU in the stacked run nor the echo server's is the
    # global tier's; the echo server's is not Tier 1's
    assert row["global_cpu_ms"] == pytest.approx(0.8) and row["tier1_cpu_ms"] == 0.9
    assert row["own_within"] and row["stacked_within"]
    points[2] = _point("global", 2.1, {**tier1, "global-globalrouter": 0.5,
                                        "global-envoy": 0.5})
    assert not _summary(points, spec)["stacked_within"]  # CPU 1.0 > 0.9
    points[2] = _point("global", 2.3, {**tier1, "global-globalrouter": 0.3,
                                        "global-envoy": 0.5})
    assert not _summary(points, spec)["stacked_within"]  # added p50 1.1 > 1.0
    assert _summary(points, spec)["own_within"]  # the stacked path does not decide it
    points[4] = _point("global-standin", 1.4, {**front, "standin": 0.1})
    assert not _summary(points, spec)["own_within"]  # own p50 1.1 > 1.0
    points[4] = _point("global-standin", 1.2, {**front, "global-envoy": 0.7})
    assert not _summary(points, spec)["own_within"]  # own CPU 1.0 > 0.9
    points[4] = _point("global-standin", 1.2, {**front, "standin": 0.1})
    doc = {"date": "d", "cores": 2, "load_average": 1.0, "halt_poll": "off",
           "command": "c", "duration_s": 8.0, "rounds": 4, "points": points,
           "summary": [_summary(points, spec)]}
    text = render(doc)
    assert "| 1 at 200/s | 0.90 | 1.00 | 0.700 | 0.900 | yes |" in text  # own
    assert "| 1 at 200/s | 1.10 | 1.00 | 0.800 | 0.900 | no |" in text  # stacked
