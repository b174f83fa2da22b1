"""The picker process: ext_proc + health + admin gRPC, metrics HTTP, collection.

Wires the datastore, the director and the metrics collector together, feeds
Envoy the pools' membership through EDS files and the pool clusters and routes
through CDS/RDS files, reloads the config when the file changes (an invalid
one is refused and the running config stays), follows Envoy's outlier
ejections (passive health), and drains open streams on SIGTERM.

A config reload that adds a pool or a pod is applied in two steps, so that no
request is ever sent where Envoy cannot route it yet: first Envoy gets the
union of the old and the new clusters, routes and members; once its admin port
shows it runs them, the picker switches to the new config and the files are
written again for the new config alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.core import Metric

from contract.config import ConfigError, GatewayConfig, load_config_text
from contract.endpoints import EndpointError, resolve_endpoints
from igw_envoy.atomic import write_atomic
from igw_envoy.eds import cluster_name, write_endpoints
from igw_envoy.xds import write_dynamic
from picker.admin import AdminService
from picker.datalayer.collector import Collector
from picker.datastore import Datastore
from picker.director import Director
from picker.discovery.static import StaticResolver
from picker.envoy_admin import EnvoyAdmin, ejected
from picker.gateway_metrics import GatewayMetrics, process_families
from picker.h2_grpc import HEALTH_CHECK_PATH, H2GrpcServer, HealthCheck
from picker.handlers import ExtProcHandler
from proto import admin_pb2_grpc

log = logging.getLogger("picker.app")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_PATH = f"/{EXT_PROC_SERVICE}/Process"
# What gRPC health answers for, on the ext_proc port and the admin port alike
# (any other service name is NOT_FOUND on both).
HEALTH_SERVICES = ("", EXT_PROC_SERVICE)
# Largest ext_proc message accepted: a body at the largest configurable limit, plus framing.
MAX_EXT_PROC_MESSAGE = 300 << 20
RELOAD_POLL_S = 1.0
DRAIN_TIMEOUT_S = 30.0
# How long a reload waits for Envoy to run the new clusters/routes before the
# picker switches anyway (Envoy down or restarting: nothing is served meanwhile).
ENVOY_APPLY_TIMEOUT_S = 10.0
RELOAD_STATUS_FILE = "reload-status.json"
LAST_GOOD_FILE = "config.last-good.yaml"
OUTLIER_POLL_S = 0.25
OUTLIER_IDLE_POLL_S = 2.0  # while Envoy's admin port does not answer


class PickerApp:
    """Owns every long-lived task of the picker process."""

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        host: str = "127.0.0.1",
        metrics_host: str | None = None,
    ) -> None:
        self.config_path = config_path
        self.state_dir = state_dir
        self.host = host
        self.metrics_host = metrics_host or host
        self._config_signature = _signature(config_path)
        self.config = self._load_initial()
        self.metrics = GatewayMetrics()
        self.datastore = Datastore(self.config)
        self.director = Director(self.datastore, self.metrics)
        self.collector = Collector(self.datastore)
        self.metrics.attach_routing(self.director, self.collector.counters)
        self.metrics.attach(self.datastore, self._process_metrics)
        self.envoy = EnvoyAdmin(self.config.envoy_admin_port)
        # The admin port's gRPC health: a copy of `_serving`, kept by `_publish_health`.
        self.health = health.aio.HealthServicer()
        self._grpc: H2GrpcServer | None = None
        self._admin: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: asyncio.Task[None] | None = None
        self._ejected: set[tuple[str, str]] = set()  # (pool, address) Envoy has ejected
        self._stopping = asyncio.Event()

    @property
    def eds_dir(self) -> Path:
        return self.state_dir / "eds"

    async def start(self) -> None:
        self.write_eds()
        write_dynamic(self.config, self.state_dir)
        self.collector.start()
        self._grpc = await self._start_ext_proc()
        self._admin = await self._start_admin()
        self._http = await self._start_http()
        self._tasks.append(asyncio.create_task(self._watch_config(), name="igw-config-watch"))
        self._tasks.append(asyncio.create_task(self._watch_outliers(), name="igw-outliers"))
        log.info(
            "picker serving ext_proc=%s:%d admin=%s:%d metrics=%s:%d pools=%s",
            self.host,
            self.config.picker_port,
            self.host,
            self.config.admin_port,
            self.metrics_host,
            self.config.metrics_port,
            ",".join(self.datastore.pools),
        )
        await self.start_discovery()
        self._resolver = StaticResolver(self.datastore, self.membership_changed)
        self._resolver.start()

    async def start_discovery(self) -> None:
        """Kubernetes pod and config-resource watches when in a cluster (see picker.discovery).

        Imported here so lightkube is only needed where discovery runs; off
        outside a pod unless IGW_DISCOVERY=kubernetes.
        """
        from picker.discovery import start_discovery

        self._discovery = await start_discovery(self)

    async def _start_ext_proc(self) -> H2GrpcServer:
        """ext_proc and gRPC health on picker.h2_grpc (see there for why not grpc.aio)."""
        handler = ExtProcHandler(self.director)
        server = H2GrpcServer(
            {
                EXT_PROC_PATH: handler.stream,
                HEALTH_CHECK_PATH: lambda stream: HealthCheck(stream, self._serving),
            },
            max_message=MAX_EXT_PROC_MESSAGE,
        )
        await server.start(self.host, self.config.picker_port)
        return server

    def _serving(self, service: str) -> int | None:
        """The serving status, the one source for every health answer the picker gives.

        SERVING until `stop_serving`, then NOT_SERVING so probes stop early;
        None (NOT_FOUND) for a service not in HEALTH_SERVICES. The ext_proc
        port asks it on every Check; the admin port's servicer holds a copy
        that `_publish_health` refreshes whenever this can change.
        """
        if service not in HEALTH_SERVICES:
            return None
        if self._stopping.is_set():
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def _publish_health(self) -> None:
        """Copy `_serving` into the admin port's health servicer (call after every change)."""
        for service in HEALTH_SERVICES:
            status = self._serving(service)
            assert status is not None
            await self.health.set(service, status)
        if self._stopping.is_set():  # final: the servicer ignores any later set()
            await self.health.enter_graceful_shutdown()

    async def stop_serving(self) -> None:
        """Both health ports say NOT_SERVING from now on (the first step of `stop`)."""
        self._stopping.set()
        await self._publish_health()

    async def _start_admin(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        admin_pb2_grpc.add_GatewayAdminServicer_to_server(AdminService(self), server)
        await self._publish_health()  # before it listens: never an answer the other port lacks
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_insecure_port(f"{self.host}:{self.config.admin_port}")
        await server.start()
        return server

    async def _start_http(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        app.router.add_get("/healthz", self._serve_health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.metrics_host, self.config.metrics_port).start()
        return runner

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain")

    async def _serve_health(self, _request: web.Request) -> web.Response:
        serving = self._serving("") == health_pb2.HealthCheckResponse.SERVING
        return web.Response(text="ok" if serving else "draining", status=200 if serving else 503)

    def write_eds(self) -> None:
        """Tell Envoy each pool's members (atomic file replace, watched by Envoy)."""
        for pool in self.datastore.pools.values():
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    @property
    def last_good_path(self) -> Path:
        return self.state_dir / LAST_GOOD_FILE

    def _load_initial(self) -> GatewayConfig:
        """The config file; if it is invalid, the last good one this picker ran.

        A config file broken while the gateway runs is refused by the reload, but
        a picker restarted after a crash would then not start at all (and the
        gateway would stay down). So each good file is kept in the state dir,
        and a restart falls back to it, saying so.
        """
        try:
            last_good: GatewayConfig | None = _read_config(self.last_good_path)[0]
        except ConfigError:
            last_good = None
        try:
            config, text = _read_config(self.config_path)
        except ConfigError as exc:
            if last_good is None:
                raise
            log.error(
                "%s is invalid (%s); starting with the last good config %s",
                self.config_path,
                exc,
                self.last_good_path,
            )
            return last_good
        if last_good is not None and (fields := restart_only_changes(last_good, config)):
            # `igw serve` writes the last good copy when it starts, so this is a restart
            # of the picker alone: Envoy still runs the old listener and ports
            log.error(
                "%s changes %s, which needs `igw serve` restarted; starting with the last "
                "good config %s",
                self.config_path,
                ", ".join(fields),
                self.last_good_path,
            )
            return last_good
        self._keep_last_good(text)
        return config

    def _keep_last_good(self, text: bytes) -> None:
        with contextlib.suppress(OSError):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.last_good_path, text)

    def reload(self) -> bool:
        """Apply the config file if it is valid; keep the running config otherwise."""
        try:
            config, text = _read_config(self.config_path)
        except ConfigError as exc:
            log.error("config reload refused, keeping the running config: %s", exc)
            self._reload_status("refused", str(exc))
            return False
        applied = self.apply_config(config)
        if applied:
            self._keep_last_good(text)
        return applied

    def _reload_status(self, result: str, message: str) -> None:
        """Count the outcome and leave it in STATE_DIR/reload-status.json for operators."""
        self.metrics.reloads.labels(result).inc()
        status = {"result": result, "message": message, "config": str(self.config_path)}
        with contextlib.suppress(OSError):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.state_dir / RELOAD_STATUS_FILE, json.dumps(status).encode())

    def apply_config(self, config: GatewayConfig) -> bool:
        """Adopt a validated config (from the file or a watched resource) without a restart.

        Returns False (and changes nothing) for a change that needs a restart.
        When the change adds a pool or a pod, Envoy is given the union of old
        and new first and the switch happens once Envoy runs it (see the module
        docstring); otherwise the switch is immediate.
        """
        needs_restart = restart_only_changes(self.config, config)
        if needs_restart:
            message = (
                f"{', '.join(needs_restart)}: cannot change while the gateway runs "
                "(restart `igw serve` to apply)"
            )
            log.error("config change refused, keeping the running config: %s", message)
            self._reload_status("refused", message)
            return False
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        self._reload_status("applied", f"pools: {', '.join(s.name for s in config.schedulers)}")
        added = self._added_members(config)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if not added or loop is None:
            self._adopt(config)
            return True
        union = union_config(self.config, config)
        for name, addresses in added.items():
            pool = self.datastore.pools.get(name)
            current = pool.members() if pool is not None else []
            write_endpoints(self.eds_dir, cluster_name(name), [*current, *addresses])
        _, rds_version = write_dynamic(union, self.state_dir)
        members = {cluster_name(n): _resolved(a) for n, a in added.items()}
        self._pending = loop.create_task(
            self._adopt_when_applied(config, rds_version, members), name="igw-config-apply"
        )
        return True

    def _added_members(self, config: GatewayConfig) -> dict[str, list[str]]:
        """Pools (name → new static endpoints) that the new config adds or grows."""
        added: dict[str, list[str]] = {}
        for sched in config.schedulers:
            pool = self.datastore.pools.get(sched.name)
            if pool is None:
                added[sched.name] = list(sched.endpoints)
            elif sched.endpoints:
                new = [a for a in sched.endpoints if a not in pool.pods]
                if new:
                    added[sched.name] = new
        return added

    async def _adopt_when_applied(
        self, config: GatewayConfig, rds_version: str, members: dict[str, list[str]]
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        ok = await self.envoy.wait_applied(rds_version, members, ENVOY_APPLY_TIMEOUT_S)
        if not ok:
            log.warning(
                "Envoy did not confirm the new routes/members within %.0fs; switching anyway",
                ENVOY_APPLY_TIMEOUT_S,
            )
        self._pending = None
        self._adopt(config)
        log.info("config switch after Envoy applied it in %.2fs", loop.time() - started)

    def _adopt(self, config: GatewayConfig) -> None:
        self.config = config
        self.datastore.apply_config(config)
        self.director.apply_config(config)
        self.collector.refresh()
        self.write_eds()
        write_dynamic(config, self.state_dir)
        self._ejected = {k for k in self._ejected if k[0] in self.datastore.pools}
        log.info("config applied: pools=%s", ",".join(self.datastore.pools))

    def membership_changed(self, pool_name: str) -> None:
        """Discovery changed a pool's pods: tell Envoy (the collector follows by itself)."""
        pool = self.datastore.pools.get(pool_name)
        if pool is not None:
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    async def _watch_config(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(RELOAD_POLL_S)
            signature = _signature(self.config_path)
            if signature != self._config_signature:
                self._config_signature = signature
                self.reload()

    async def _watch_outliers(self) -> None:
        """Follow Envoy's outlier ejections: an ejected pod is not ready until released."""
        while not self._stopping.is_set():
            hosts = await self.envoy.hosts()
            if hosts is not None:
                self.apply_outliers(hosts)
            await asyncio.sleep(OUTLIER_POLL_S if hosts is not None else OUTLIER_IDLE_POLL_S)

    def apply_outliers(self, hosts: dict[str, dict[str, str]]) -> None:
        """Mark pods Envoy has ejected not ready, and ready again once released."""
        now_ejected: set[tuple[str, str]] = set()
        for pool in self.datastore.pools.values():
            flags = hosts.get(pool.cluster_name)
            if not flags:
                continue
            for address, pod in pool.pods.items():
                if ejected(flags.get(address, "")):
                    now_ejected.add((pool.name, address))
                    if pool.table.ready[pod.row]:
                        pool.table.ready[pod.row] = False
                        log.warning(
                            "pod %s (pool %s) ejected by Envoy: not ready", address, pool.name
                        )
        for pool_name, address in self._ejected - now_ejected:
            pool = self.datastore.pools.get(pool_name)
            pod = pool.pods.get(address) if pool is not None else None
            if pod is not None and not pool.table.ready[pod.row]:
                pool.table.ready[pod.row] = True
                log.info("pod %s (pool %s) released by Envoy: ready again", address, pool_name)
        self._ejected = now_ejected

    def _process_metrics(self) -> Iterator[Metric]:
        return process_families(len(self._ejected))

    async def stop(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Stop taking new streams, let open ones (in-flight requests) finish."""
        await self.stop_serving()
        for task in self._tasks:
            task.cancel()
        if self._pending is not None:
            self._pending.cancel()
        if (discovery := getattr(self, "_discovery", None)) is not None:
            await discovery.stop()
        if (resolver := getattr(self, "_resolver", None)) is not None:
            await resolver.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=drain_timeout)
        if self._admin is not None:
            await self._admin.stop(grace=1.0)
        await self.collector.stop()
        await self.envoy.close()
        if self._http is not None:
            await self._http.cleanup()

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        await self.start()
        await done.wait()
        log.info("picker draining")
        await self.stop()


def _read_config(path: Path) -> tuple[GatewayConfig, bytes]:
    """The parsed config and the exact bytes it came from (what is kept as last good)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return load_config_text(data.decode("utf-8", "replace")), data


def _signature(path: Path) -> tuple[int, int, int]:
    """What tells a changed file: mtime in ns, size and inode (a ConfigMap swaps the file)."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    return (0, 0, 0)


def _resolved(addresses: list[str]) -> list[str]:
    try:
        return [ip for ip, _ in resolve_endpoints(addresses)]
    except EndpointError:
        return []


def union_config(old: GatewayConfig, new: GatewayConfig) -> GatewayConfig:
    """`new` plus the pools only `old` has: what Envoy must route while the picker switches.

    Used only to render clusters and routes (never validated as a config: a
    model may appear in two pools while it moves from one to the other).
    """
    names = {s.name for s in new.schedulers}
    extra = tuple(s for s in old.schedulers if s.name not in names)
    return dataclasses.replace(new, schedulers=new.schedulers + extra)


def restart_only_changes(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The config fields that differ and cannot change without a restart."""
    checks = {
        "spec.listener": (old.listen_address, old.listen_port)
        != (new.listen_address, new.listen_port),
        "spec.ports": (old.picker_port, old.admin_port, old.metrics_port, old.envoy_admin_port)
        != (new.picker_port, new.admin_port, new.metrics_port, new.envoy_admin_port),
        "spec.failureMode": old.failure_mode != new.failure_mode,
        "spec.bbr.maxRequestBodyBytes": old.bbr.max_request_body_bytes
        != new.bbr.max_request_body_bytes,
        "spec.tls": old.tls != new.tls,
        "spec.auth": old.jwt != new.jwt,
    }
    return [name for name, changed in checks.items() if changed]
