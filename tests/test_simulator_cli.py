"""The simulator as a process: ready line, serving, clean exit on SIGTERM, exit on crash."""

from __future__ import annotations

import json
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.procs import Child, free_port_base, start_piped, wait_line
from simulator.cli import main

REPO = Path(__file__).resolve().parent.parent


def launch(*args: str) -> Child:
    sim = start_piped("simulator", [sys.executable, "-m", "simulator", *args], cwd=REPO,
                      env={"PYTHONUNBUFFERED": "1"})
    line = wait_line(sim, lambda _: True, 30)  # the first line must be the ready line
    if not line.startswith("simulator ready"):
        sim.stop()
        raise AssertionError(f"no ready line: {line!r}")
    return sim


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_cli_serves_until_sigterm() -> None:
    port = free_port_base(2)
    sim = launch("--gpu", "h100,a10g", "--model", "m", "--port-base", str(port))
    try:
        for p in (port, port + 1):
            answer = post(f"http://127.0.0.1:{p}/v1/chat/completions",
                          {"model": "m", "max_tokens": 3,
                           "messages": [{"role": "user", "content": "hi"}]})
            assert answer["usage"]["completion_tokens"] == 3  # type: ignore[index]
        sim.proc.send_signal(signal.SIGTERM)
        assert sim.proc.wait(timeout=10) == 0
    finally:
        sim.stop()


def test_lone_pod_process_exits_on_crash(tmp_path: Path) -> None:
    port = free_port_base(2)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"seed: 3\npods:\n  - {{name: solo, gpu: a100, model: qwen3-32b, "
                     f"port: {port}, engine: sglang}}\n")
    sim = launch("--fleet", str(fleet), "--time-scale", "10")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/state", timeout=5) as r:
            state = json.loads(r.read())
        assert state["profile"]["tensor_parallel"] == 2 and state["time_scale"] == 10
        post(f"http://127.0.0.1:{port}/admin/faults", {"crash": True})
        assert sim.proc.wait(timeout=10) == 1
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        sim.stop()


def test_cli_rejects_bad_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("pods:\n  - {gpu: h100, model: m, speed: 11}\n")
    assert main(["--fleet", str(bad)]) == 2
    assert "speed" in capsys.readouterr().err
    assert main(["--gpu", "h100", "--time-scale", "0.5"]) == 2
