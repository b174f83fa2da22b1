"""Real processes for integration tests: a simulated fleet and the gateway.

Each is started on free loopback ports, waited for by its own ready line, and
always stopped by PID (SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from igw.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


class _LineReader:
    """One thread per child reading its stdout into a queue (until `discard`).

    A selector on the pipe plus `readline()` on the buffered text stream can miss a
    line: one read may pull two lines into Python's buffer, the selector then waits
    for the pipe, which has nothing more (measured: the gateway's URL line arrived
    together with an Envoy access-log line, and the wait timed out after 60 s).
    """

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._discard = False
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream: Any) -> None:
        for line in stream:
            if not self._discard:
                self.lines.put(line)
        self.lines.put(None)

    def discard(self) -> None:
        """Keep draining the pipe (a full pipe blocks the child) but keep nothing."""
        self._discard = True
        with contextlib.suppress(queue.Empty):
            while True:
                self.lines.get_nowait()


_READERS: weakref.WeakKeyDictionary[subprocess.Popen[str], _LineReader] = (
    weakref.WeakKeyDictionary()
)


def _reader(proc: subprocess.Popen[str]) -> _LineReader:
    reader = _READERS.get(proc)
    if reader is None:
        assert proc.stdout is not None
        reader = _READERS[proc] = _LineReader(proc.stdout)
    return reader


def _wait_line(proc: subprocess.Popen[str], predicate, timeout: float) -> str:
    """Read stdout lines until one matches; fail with the process's output if it dies."""
    reader = _reader(proc)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = reader.lines.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if line is None:  # end of output: the process is gone
            break
        seen.append(line)
        if predicate(line):
            return line.strip()
    stop(proc)
    raise RuntimeError(f"process not ready (exit {proc.returncode}); output:\n{''.join(seen)}")


def _drain_output(proc: subprocess.Popen[str]) -> None:
    """Keep reading a child's stdout after its ready line. Envoy's access log goes
    there: an undrained pipe fills after ~64 KiB and then blocks Envoy's log-flush
    thread, which makes Envoy hang on SIGTERM (it joins that thread)."""
    _reader(proc).discard()


def stop(proc: subprocess.Popen[Any], timeout: float = 15.0) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
    return proc.returncode


@dataclass
class SimFleet:
    proc: subprocess.Popen[str]
    pods: list[dict[str, Any]]
    control_port: int

    def address(self, name: str) -> str:
        pod = next(p for p in self.pods if p["name"] == name)
        return f"127.0.0.1:{pod['port']}"

    def addresses(self, model: str | None = None) -> list[str]:
        return [f"127.0.0.1:{p['port']}" for p in self.pods if model in (None, p["model"])]

    def name_of(self, address: str) -> str:
        port = int(address.rsplit(":", 1)[1])
        return next(p["name"] for p in self.pods if p["port"] == port)


@contextlib.contextmanager
def sim_fleet(tmp: Path, pods: list[dict[str, Any]], **top: Any) -> Iterator[SimFleet]:
    """Run `python -m simulator --fleet FILE` with the given pods on free ports."""
    ports = free_ports(len(pods) + 1)
    pods = [{**p, "port": port} for p, port in zip(pods, ports, strict=False)]
    spec = {"seed": 1, **top, "pods": pods}
    path = tmp / f"fleet-{ports[0]}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen(
        [sys.executable, "-m", "simulator", "--fleet", str(path), "--control-port", str(ports[-1])],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp,
        start_new_session=True,
    )
    try:
        _wait_line(proc, lambda line: "simulator ready" in line, 30)
        yield SimFleet(proc, pods, ports[-1])
    finally:
        stop(proc)


@dataclass
class Gateway:
    proc: subprocess.Popen[str]
    url: str
    state_dir: Path
    config_path: Path
    config: dict[str, Any]
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def ca(self) -> Path:
        return self.state_dir / "tls" / "ca.pem"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.ports['admin']}"


def gateway_config(schedulers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    """A config document with free ports for every listener."""
    listen, picker, admin, metrics, envoy_admin = free_ports(5)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "test"},
        "spec": {
            "tls": {},
            "bbr": {"enabled": True},
            "schedulers": schedulers,
            "listener": {"address": "127.0.0.1", "port": listen},
            "ports": {
                "picker": picker,
                "admin": admin,
                "metrics": metrics,
                "envoyAdmin": envoy_admin,
            },
            **spec,
        },
    }


@contextlib.contextmanager
def gateway(
    tmp: Path, config: dict[str, Any], timeout: float = 60, extra_args: tuple[str, ...] = ()
) -> Iterator[Gateway]:
    """Run `igw serve` on a config document; yields once its URL line is printed."""
    state = tmp / f"gw-{config['spec']['listener']['port']}"
    state.mkdir(parents=True, exist_ok=True)
    path = state / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "igw.cli",
            "serve",
            "--config",
            str(path),
            "--state-dir",
            str(state),
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = _wait_line(proc, lambda line: line.startswith("https://"), timeout)
        _drain_output(proc)
        ports = dict(config["spec"]["ports"])
        ports["listen"] = config["spec"]["listener"]["port"]
        yield Gateway(proc, url, state, path, config, ports)
    finally:
        stop(proc, timeout=40)
