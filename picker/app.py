"""The picker process: ext_proc + health + admin gRPC, metrics HTTP, collection.

Its lifecycle: wires the datastore, the director and the metrics collector
together, starts the servers and the background parts, feeds Envoy the pools'
membership through EDS files and the pool clusters and routes through CDS/RDS
files, and drains open streams on SIGTERM. Deciding whether and when a new
config replaces the running one is picker.reload; following Envoy's outlier
ejections is picker.outliers. What a config switch touches (every part, and
Envoy's files) is here, in `_adopt`, because this is what owns the parts.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.core import Metric

from contract import headers as hdr
from contract.config import GatewayConfig
from igw_envoy.eds import write_endpoints
from igw_envoy.usage import measures_usage
from igw_envoy.xds import write_dynamic
from picker.access_log import ACCESS_LOG_PATH, AccessLogStream
from picker.admin import AdminService
from picker.coordination import Coordinator
from picker.datalayer.collector import Collector
from picker.datastore import Datastore
from picker.director import Director
from picker.discovery.static import StaticResolver
from picker.envoy_admin import EnvoyAdmin
from picker.gateway_metrics import GatewayMetrics, process_families
from picker.h2_grpc import HEALTH_CHECK_PATH, H2GrpcServer, HandlerFactory, HealthCheck
from picker.handlers import ExtProcHandler
from picker.load_summary import LoadSummary
from picker.outliers import OutlierFollower
from picker.reload import ConfigReloader, load_initial
from picker.tenants.limits import Limiter
from picker.tenants.usage import UsageLedger
from proto import admin_pb2_grpc

log = logging.getLogger("picker.app")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXT_PROC_PATH = f"/{EXT_PROC_SERVICE}/Process"
# What gRPC health answers for, on the ext_proc port and the admin port alike
# (any other service name is NOT_FOUND on both).
HEALTH_SERVICES = ("", EXT_PROC_SERVICE)
# Largest ext_proc message accepted: a body at the largest configurable limit, plus framing.
MAX_EXT_PROC_MESSAGE = 300 << 20
DRAIN_TIMEOUT_S = 30.0


class PickerApp:
    """Owns every long-lived task of the picker process."""

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        host: str = "127.0.0.1",
        metrics_host: str | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.host = host
        self.metrics_host = metrics_host or host
        config, signature = load_initial(config_path, state_dir)
        self.metrics = GatewayMetrics()
        self.datastore = Datastore(config)
        # spec.tenants' limits; whether they are on and how they fail is restart-only.
        self.limiter = (
            Limiter(failure_mode=config.tenants.failure_mode)
            if config.tenants is not None else None
        )
        # Output tokens per tenant request, from Envoy's access log (spec.tenants).
        self.ledger = UsageLedger(self.limiter) if measures_usage(config) else None
        self.director = Director(
            self.datastore, self.metrics, limiter=self.limiter, ledger=self.ledger
        )
        self.collector = Collector(self.datastore)
        # What the global router reads (Tier 2): rebuilt in the background, served as is.
        self.summary = LoadSummary(self.director, config.name)
        self.envoy = EnvoyAdmin(config.envoy_admin_port)
        self.outliers = OutlierFollower(self.datastore, self.envoy)
        self.metrics.attach_routing(self.director, self.collector.counters)
        self.metrics.attach(self.datastore, self._process_metrics)
        # Shared routing state with the other gateway replicas (spec.coordination).
        self.coordination = (
            Coordinator(config, self.director, collector=self.collector)
            if config.coordination is not None else None
        )
        if self.coordination is not None:
            self.metrics.attach_coordination(self.coordination)
        if config.tenants is not None:
            self.metrics.attach_tenants(self.director.tenants, self.limiter, self.ledger)
        self.reloader = ConfigReloader(
            config,
            signature,
            config_path,
            state_dir,
            eds_dir=self.eds_dir,
            datastore=self.datastore,
            envoy=self.envoy,
            reloads=self.metrics.reloads,
            adopt=self._adopt,
        )
        # The admin port's gRPC health: a copy of `_serving`, kept by `_publish_health`.
        self.health = health.aio.HealthServicer()
        self._grpc: H2GrpcServer | None = None
        self._admin: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    @property
    def eds_dir(self) -> Path:
        return self.state_dir / "eds"

    @property
    def config(self) -> GatewayConfig:
        """The running config (picker.reload switches it)."""
        return self.reloader.config

    async def start(self) -> None:
        self.write_eds()
        write_dynamic(self.config, self.state_dir)
        self.collector.start()
        if self.coordination is not None:
            self.coordination.start()
        await self._start_tenants()
        self._grpc = await self._start_ext_proc()
        self._admin = await self._start_admin()
        self._http = await self._start_http()
        watch_config = self.reloader.watch(self._stopping)
        self._tasks.append(asyncio.create_task(watch_config, name="igw-config-watch"))
        watch_outliers = self.outliers.watch(self._stopping)
        self._tasks.append(asyncio.create_task(watch_outliers, name="igw-outliers"))
        summary = self.summary.run(self._stopping)
        self._tasks.append(asyncio.create_task(summary, name="igw-load-summary"))
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

    async def _start_tenants(self) -> None:
        """Watch the keys file; start the limits, shared through the coordination Redis
        when spec.coordination is set (else each replica enforces them alone)."""
        if self.config.tenants is None or self.limiter is None:
            return
        watch_keys = self.director.tenants.watch(self._stopping)
        self._tasks.append(asyncio.create_task(watch_keys, name="igw-tenant-keys"))
        if self.ledger is not None:
            sweep = self.ledger.sweeper(self._stopping)
            self._tasks.append(asyncio.create_task(sweep, name="igw-usage-sweep"))
        await self.limiter.start_shared(
            self.config.coordination,
            self.config.coordination_prefix,
            replica=self.coordination.replica if self.coordination is not None else None,
        )

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
        methods: dict[str, HandlerFactory] = {
            EXT_PROC_PATH: handler.stream,
            HEALTH_CHECK_PATH: lambda stream: HealthCheck(stream, self._serving),
        }
        ledger = self.ledger
        if ledger is not None:
            methods[ACCESS_LOG_PATH] = lambda stream: AccessLogStream(ledger, stream)
        server = H2GrpcServer(methods, max_message=MAX_EXT_PROC_MESSAGE)
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
        self.summary.stop_serving()
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
        app.router.add_get(hdr.LOAD_SUMMARY_PATH, self._serve_summary)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.metrics_host, self.config.metrics_port).start()
        return runner

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain")

    async def _serve_summary(self, _request: web.Request) -> web.Response:
        """The load summary as last built (503 while draining, so health checks fail)."""
        return web.Response(
            body=self.summary.body,
            status=200 if self.summary.serving else 503,
            content_type="application/json",
            headers={"cache-control": "no-store"},
        )

    async def _serve_health(self, _request: web.Request) -> web.Response:
        serving = self._serving("") == health_pb2.HealthCheckResponse.SERVING
        return web.Response(text="ok" if serving else "draining", status=200 if serving else 503)

    def write_eds(self) -> None:
        """Tell Envoy each pool's members (atomic file replace, watched by Envoy)."""
        for pool in self.datastore.pools.values():
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    def apply_config(self, config: GatewayConfig) -> bool:
        """Discovery's config resource changed (DiscoveryTarget): the file's reload path."""
        return self.reloader.apply(config)

    def _adopt(self, config: GatewayConfig) -> None:
        """Switch every part to `config` and write Envoy's files for it alone."""
        self.datastore.apply_config(config)
        self.director.apply_config(config)
        self.collector.refresh()
        self.write_eds()
        write_dynamic(config, self.state_dir)
        self.outliers.forget_removed_pools()
        log.info("config applied: pools=%s", ",".join(self.datastore.pools))

    def membership_changed(self, pool_name: str) -> None:
        """Discovery changed a pool's pods: tell Envoy (the collector follows by itself)."""
        pool = self.datastore.pools.get(pool_name)
        if pool is not None:
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    def _process_metrics(self) -> Iterator[Metric]:
        return process_families(self.outliers.ejected_count)

    async def stop(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Stop taking new streams, let open ones (in-flight requests) finish."""
        await self.stop_serving()
        for task in self._tasks:
            task.cancel()
        self.reloader.cancel_pending()
        if (discovery := getattr(self, "_discovery", None)) is not None:
            await discovery.stop()
        if (resolver := getattr(self, "_resolver", None)) is not None:
            await resolver.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=drain_timeout)
        if self.coordination is not None:  # after the drain: its completions are shared
            await self.coordination.stop()
        if self.limiter is not None:  # after the drain too: releases are counted
            await self.limiter.stop()
        if self._admin is not None:
            await self._admin.stop(grace=1.0)
        await self.collector.stop()
        await self.envoy.close()
        if self._http is not None:
            await self._http.cleanup()

    async def run_until_signalled(self) -> None:
        await serve_until_signalled(self.start, self.stop, "picker", self.reloader.reload)


async def serve_until_signalled(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    name: str,
    on_hangup: Callable[[], object] | None = None,
) -> None:
    """Start, wait for SIGTERM or SIGINT (SIGHUP calls `on_hangup`), then stop: the
    picker's process and the global router's."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    await start()
    await done.wait()
    log.info("%s draining", name)
    await stop()
