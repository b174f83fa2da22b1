"""Real processes for integration tests: a simulated fleet and the gateway.

Each is started on free loopback ports by bench/procs.py (the one process helper),
waited for by its own ready line on stdout, and always stopped by PID (SIGTERM, then
SIGKILL) when the test ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.procs import start_piped, wait_line
from igw.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class SimFleet:
    proc: subprocess.Popen[bytes]
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
    child = start_piped(
        "simulator",
        [sys.executable, "-m", "simulator", "--fleet", str(path), "--control-port", str(ports[-1])],
        cwd=tmp,
    )
    try:
        wait_line(child, lambda line: "simulator ready" in line, 30)
        yield SimFleet(child.proc, pods, ports[-1])
    finally:
        child.stop(timeout=15)


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
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
    command = ["serve", "--config", str(path), "--state-dir", str(state), *extra_args]
    with _igw_url("igw serve", command, timeout) as (proc, url):
        ports = dict(config["spec"]["ports"])
        ports["listen"] = config["spec"]["listener"]["port"]
        yield Gateway(proc, url, state, path, config, ports)


@contextlib.contextmanager
def _igw_url(label: str, command: list[str], timeout: float
             ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`igw COMMAND...` until its first line, the https:// URL; its stdout (Envoy's access
    log) drained from then on; stopped by PID (SIGTERM, then SIGKILL) at the end."""
    child = start_piped(label, [sys.executable, "-m", "igw.cli", *command])
    try:
        url = wait_line(child, lambda line: line.startswith("https://"), timeout)
        child.drain()
        yield child.proc, url
    finally:
        child.stop(timeout=40)


def mint_key(keys_file: Path, tenant: str) -> str:
    """A new API key for `tenant`, its hash line added to `keys_file`, through the real
    `igw tenants add-key` (the key is printed once)."""
    done = subprocess.run(
        [sys.executable, "-m", "igw.cli", "tenants", "add-key", tenant, "--keys-file",
         str(keys_file)], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


@dataclass
class GlobalRouter:
    proc: subprocess.Popen[bytes]
    url: str
    state_dir: Path
    config: dict[str, Any]

    @property
    def ca(self) -> Path:
        return self.state_dir / "tls" / "ca.pem"

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.config['spec']['ports']['metrics']}/regions"


def global_config(regions: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    """A GlobalRouterConfig document with free ports for every listener."""
    listen, picker, metrics, envoy_admin = free_ports(4)
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "GlobalRouterConfig",
        "metadata": {"name": "test-global"},
        "spec": {
            "regions": regions,
            "listener": {"address": "127.0.0.1", "port": listen},
            "ports": {"picker": picker, "metrics": metrics, "envoyAdmin": envoy_admin},
            **spec,
        },
    }


@contextlib.contextmanager
def global_router(tmp: Path, config: dict[str, Any], timeout: float = 60) -> Iterator[GlobalRouter]:
    """Run `igw global serve` on a config document; yields once its URL line is printed."""
    state = tmp / f"global-{config['spec']['listener']['port']}"
    state.mkdir(parents=True, exist_ok=True)
    path = state / "global.yaml"
    path.write_text(yaml.safe_dump(config))
    command = ["global", "serve", "--config", str(path), "--state-dir", str(state)]
    with _igw_url("igw global serve", command, timeout) as (proc, url):
        yield GlobalRouter(proc, url, state, config)
