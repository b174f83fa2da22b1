"""`igw serve` and `igw up`: Envoy + the picker (+ a simulated fleet) as supervised children."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.config import ConfigError, GatewayConfig, load_config
from contract.global_config import GlobalRouterConfig
from igw.ports import free_ports
from igw.supervisor import ChildSpec, Supervisor, run_until_signalled
from igw_envoy.atomic import write_atomic
from igw_envoy.binary import find_envoy
from igw_envoy.render import write_bootstrap

log = logging.getLogger("igw.gateway")

READY_TIMEOUT_S = 60.0
LAST_GOOD_FILE = "config.last-good.yaml"  # = picker.reload.LAST_GOOD_FILE
DRAIN_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.1
ACTIVE_REQUESTS_STAT = "http.ingress_https.downstream_rq_active"


def effective_config(config: GatewayConfig, port: int | None) -> GatewayConfig:
    return config if port is None else dataclasses.replace(config, listen_port=port)


def gateway_children(
    config_path: Path,
    state_dir: Path,
    port: int | None,
    log_level: str = "INFO",
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> list[ChildSpec]:
    """The picker first (Envoy's ext_proc calls it), then Envoy.

    Everything Envoy reads is rendered once here. When Envoy is restarted (it
    crashed), only its bootstrap is written again, from the last config that
    could be applied while running: the CDS/RDS/EDS files belong to the picker
    by then (it rewrites them on every reload), and a listener or port change
    in the file needs `igw serve` itself restarted, as the picker says.
    """
    envoy_yaml = state_dir / "envoy.yaml"
    first = effective_config(load_config(config_path), port)
    current = {"config": first}

    def render_restart() -> None:
        from picker.reload import restart_only_changes

        try:
            config = effective_config(load_config(config_path), port)
        except ConfigError as exc:
            log.warning(
                "envoy restart: %s is invalid (%s); using the last good config", config_path, exc
            )
            config = current["config"]
        if restart_only_changes(first, config):
            config = current["config"]
        current["config"] = config
        write_bootstrap(config, state_dir, dynamic_files=False)

    write_bootstrap(first, state_dir)
    # What the picker falls back to if it is restarted while the file is broken (or
    # changes what only a restart of `igw serve` can change): this start's file.
    write_atomic(state_dir / LAST_GOOD_FILE, config_path.read_bytes())
    picker = ChildSpec(
        name="picker",
        # Large request bodies: keep glibc from returning (and re-faulting) big
        # buffers on every request (measured: 256 KiB parse 330 µs → 120 µs).
        env={"MALLOC_MMAP_THRESHOLD_": "67108864", "MALLOC_TRIM_THRESHOLD_": "134217728"},
        argv=[
            sys.executable,
            "-m",
            "picker",
            "--config",
            str(config_path),
            "--state-dir",
            str(state_dir),
            "--log-level",
            log_level,
        ],
        stop_timeout_s=drain_timeout_s + 5.0,
    )
    envoy = envoy_child(envoy_yaml, first.envoy_admin_port, drain_timeout_s, render_restart)
    return [picker, envoy]


def envoy_child(
    envoy_yaml: Path,
    admin_port: int,
    drain_timeout_s: float,
    before_start: Callable[[], None] | None = None,
) -> ChildSpec:
    """Envoy on a rendered bootstrap, drained (listeners closed, in-flight requests
    finished, bounded) before it is signalled; the global router's front door too."""
    return ChildSpec(
        name="envoy",
        argv=[
            find_envoy(),
            "-c",
            str(envoy_yaml),
            "--log-level",
            "warn",
            "--use-dynamic-base-id",
            "--drain-time-s",
            "5",
            "--parent-shutdown-time-s",
            "10",
        ],
        before_start=before_start,
        before_stop=lambda: drain_envoy(admin_port, drain_timeout_s),
        stop_timeout_s=10.0,
    )


async def drain_envoy(admin_port: int, timeout_s: float) -> None:
    """Graceful stop: Envoy stops accepting connections, in-flight requests (streams
    included) run to their end, bounded by `timeout_s`; then the caller signals it."""
    import aiohttp

    base = f"http://127.0.0.1:{admin_port}"
    deadline = time.monotonic() + timeout_s
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.post(f"{base}/drain_listeners") as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("envoy drain: admin port unreachable (%s); stopping it now", exc)
            return
        log.info("envoy: listeners closed; waiting up to %.0fs for in-flight requests", timeout_s)
        while time.monotonic() < deadline:
            try:
                async with session.get(
                    f"{base}/stats", params={"filter": f"^{ACTIVE_REQUESTS_STAT}$"}
                ) as r:
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                return
            active = _stat_value(text, ACTIVE_REQUESTS_STAT)
            if not active:
                log.info("envoy: no request in flight; stopping")
                return
            await asyncio.sleep(DRAIN_POLL_S)
        log.warning("envoy: drain timeout (%.0fs) reached with requests in flight", timeout_s)


def _stat_value(text: str, name: str) -> int | None:
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key.strip() == name:
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def wait_ready(
    config: GatewayConfig | GlobalRouterConfig, deadline_s: float = READY_TIMEOUT_S
) -> None:
    """Until the picker answers gRPC health, Envoy's admin says LIVE (every listener, cluster
    and route file loaded) and the HTTPS listener completes a TLS handshake.

    No HTTP request is sent to the listener: it would be the first line of Envoy's access
    log on stdout, before the URL that `igw serve` / `igw up` promise as their first line.
    """
    deadline = time.monotonic() + deadline_s
    await _wait(lambda: _picker_serving(config.picker_port), deadline, "picker")
    await _wait(lambda: _envoy_live(config.envoy_admin_port), deadline, "envoy")
    host = "127.0.0.1" if config.listen_address in ("0.0.0.0", "::") else config.listen_address
    await _wait(lambda: _tls_accepted(host, config.listen_port), deadline, "envoy listener")


async def _wait(probe, deadline: float, what: str) -> None:
    while time.monotonic() < deadline:
        if await probe():
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} not ready in time")


async def _picker_serving(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def _envoy_live(admin_port: int) -> bool:
    """Envoy's admin `/ready`: 200 once the server is LIVE (its init manager done)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", admin_port), 1.0
        )
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(b"GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), 1.0)
        return b" 200 " in line
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()


async def _tls_accepted(host: str, port: int) -> bool:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx), 1.0
        )
    except (OSError, TimeoutError, ssl.SSLError):
        return False
    writer.close()
    return True


def announce(config: GatewayConfig, state_dir: Path, sample: bool) -> None:
    """First line: the URL. Then how to trust the certificate and try it."""
    url = f"https://127.0.0.1:{config.listen_port}"
    _line(url)
    ca = state_dir / "tls" / "ca.pem"
    if config.tls.certificate_file is None:
        _line(f"# self-signed CA (trust it): {ca}")
    if sample:
        model = config.schedulers[0].model_name
        _line(
            f"# try: curl --cacert {ca} {url}/v1/chat/completions "
            f"-H 'content-type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", '
            f'"content": "hello"}}], "max_tokens": 16}}\''
        )


def _line(text: str) -> None:
    """One line in one write: Envoy's access log shares this stdout, and `print` under
    PYTHONUNBUFFERED writes the text and its newline separately, so an access-log
    line could land between them (measured: the URL line came out glued to one)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def serve(
    config_path: Path, state_dir: Path, port: int | None, drain_timeout_s: float = DRAIN_TIMEOUT_S
) -> int:
    config = effective_config(load_config(config_path), port)
    state_dir.mkdir(parents=True, exist_ok=True)
    children = gateway_children(config_path, state_dir, port, drain_timeout_s=drain_timeout_s)
    return await supervise(children, config, lambda: announce(config, state_dir, sample=False))


async def supervise(
    children: list[ChildSpec],
    config: GatewayConfig | GlobalRouterConfig,
    announce_ready: Callable[[], None],
) -> int:
    """Run `children` until SIGTERM/SIGINT; once `config`'s picker (or global router),
    Envoy and listener are ready, `announce_ready` prints the URL line first."""

    async def ready() -> None:
        await wait_ready(config)
        announce_ready()

    return await run_until_signalled(Supervisor(children), ready)


def default_fleet() -> dict:
    return yaml.safe_load(resources.files("igw").joinpath("default_fleet.yaml").read_text())


def up_files(state_dir: Path, port: int) -> tuple[Path, Path]:
    """Write the embedded fleet and a gateway config pointing at it, on free ports."""
    fleet = default_fleet()
    config = fleet_gateway("igw-up", fleet["pods"], "127.0.0.1", port)
    return write_up_files(state_dir, fleet, config)


def fleet_port_count(pods: list[dict]) -> int:
    """How many 127.0.0.1 ports `fleet_gateway` needs for `pods`."""
    return len(pods) + 4


def fleet_gateway(name: str, pods: list[dict], address: str, port: int,
                  ports: list[int] | None = None) -> dict:
    """A gateway config document for simulated `pods`: one pool per model with its
    pods' adapters, listening on address:port. `ports` (one per pod, then picker,
    admin, metrics, Envoy admin; all on 127.0.0.1) are chosen in one `free_ports`
    call unless given: one at a time, the OS handed the same port out twice (`igw
    global up`: "pods: host:port pairs must be unique")."""
    chosen = free_ports(fleet_port_count(pods)) if ports is None else ports
    *pod_ports, picker, admin, metrics, envoy_admin = chosen
    by_model: dict[str, list[str]] = {}
    for pod, pod_port in zip(pods, pod_ports, strict=True):
        pod["port"] = pod_port
        by_model.setdefault(pod["model"], []).append(f"127.0.0.1:{pod['port']}")
    schedulers = []
    for i, (model, endpoints) in enumerate(by_model.items()):
        adapters = sorted(
            {a for p in pods if p["model"] == model for a in p.get("lora_adapters", [])}
        )
        schedulers.append(
            {
                "name": f"pool-{i}-{model.replace('.', '-').lower()}"[:63].rstrip("-"),
                "modelName": model,
                "endpoints": endpoints,
                "loraAdapters": adapters,
                "engineType": "vllm",
            }
        )
    return {
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "metadata": {"name": name},
        "spec": {
            "tls": {},
            "bbr": {"enabled": True},
            "schedulers": schedulers,
            "listener": {"address": address, "port": port},
            "ports": {"picker": picker, "admin": admin, "metrics": metrics,
                      "envoyAdmin": envoy_admin},
        },
    }


def write_up_files(state_dir: Path, fleet: dict, config: dict) -> tuple[Path, Path]:
    """fleet.yaml and gateway.yaml in `state_dir`; their paths."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fleet_path, config_path = state_dir / "fleet.yaml", state_dir / "gateway.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return fleet_path, config_path


def simulator_child(fleet_path: Path, name: str = "simulator") -> ChildSpec:
    """The simulated fleet of `fleet_path`; its output kept off our stdout."""
    return ChildSpec(
        name=name,
        argv=[sys.executable, "-m", "simulator", "--fleet", str(fleet_path)],
        stdout_to_stderr=True,
    )


async def up(state_dir: Path, port: int) -> int:
    fleet_path, config_path = up_files(state_dir, port)
    config = load_config(config_path)
    supervisor = Supervisor(
        [simulator_child(fleet_path), *gateway_children(config_path, state_dir, None)]
    )

    async def ready() -> None:
        await wait_ready(config)
        announce(config, state_dir, sample=True)
        print(f"# fleet: {fleet_path}  config: {config_path}", flush=True)
        # `igw up` picks free ports, so the admin commands' default address is not it.
        print(f"# admin: igw status --admin 127.0.0.1:{config.admin_port}", flush=True)

    return await run_until_signalled(supervisor, ready)
