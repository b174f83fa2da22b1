"""The picker process: ext_proc + health + admin gRPC, metrics HTTP, collection.

Wires the datastore, the director and the metrics collector together, feeds
Envoy the pools' membership through EDS files, reloads the config when the
file changes (an invalid one is refused and the running config stays), and
drains open streams on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from igw_envoy.eds import write_endpoints
from picker.admin import AdminService
from picker.config import ConfigError, GatewayConfig, load_config
from picker.datalayer.collector import Collector
from picker.datastore import Datastore
from picker.director import Director
from picker.gateway_metrics import GatewayMetrics
from picker.handlers import ExtProcHandler
from proto import admin_pb2_grpc

log = logging.getLogger("picker.app")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RELOAD_POLL_S = 1.0
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
        self.config_path = config_path
        self.state_dir = state_dir
        self.host = host
        self.metrics_host = metrics_host or host
        self.config = load_config(config_path)
        self._config_mtime = _mtime(config_path)
        self.metrics = GatewayMetrics()
        self.datastore = Datastore(self.config)
        self.director = Director(self.datastore, self.metrics)
        self.collector = Collector(self.datastore)
        self.metrics.attach(self.datastore)
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._admin: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    @property
    def eds_dir(self) -> Path:
        return self.state_dir / "eds"

    async def start(self) -> None:
        self.write_eds()
        self.collector.start()
        self._grpc = await self._start_ext_proc()
        self._admin = await self._start_admin()
        self._http = await self._start_http()
        self._tasks.append(asyncio.create_task(self._watch_config()))
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
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

    async def start_discovery(self) -> None:
        """Kubernetes pod and config-resource watches when in a cluster (see picker.discovery).

        Imported here so lightkube is only needed where discovery runs; off
        outside a pod unless IGW_DISCOVERY=kubernetes.
        """
        from picker.discovery import start_discovery

        self._discovery = await start_discovery(self)

    async def _start_ext_proc(self) -> grpc.aio.Server:
        handler = ExtProcHandler(self.director)
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 300 << 20)]
        )
        method = grpc.stream_stream_rpc_method_handler(
            handler.process,
            request_deserializer=ext_proc.ProcessingRequest.FromString,
            response_serializer=None,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method}),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        server.add_insecure_port(f"{self.host}:{self.config.picker_port}")
        await server.start()
        return server

    async def _start_admin(self) -> grpc.aio.Server:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        admin_pb2_grpc.add_GatewayAdminServicer_to_server(AdminService(self), server)
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
        return web.Response(
            text="ok" if not self._stopping.is_set() else "draining",
            status=200 if not self._stopping.is_set() else 503,
        )

    def write_eds(self) -> None:
        """Tell Envoy each pool's members (atomic file replace, watched by Envoy)."""
        for pool in self.datastore.pools.values():
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    def reload(self) -> bool:
        """Apply the config file if it is valid; keep the running config otherwise."""
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            log.error("config reload refused, keeping the running config: %s", exc)
            return False
        return self.apply_config(config)

    def apply_config(self, config: GatewayConfig) -> bool:
        """Adopt a validated config (from the file or a watched resource) without a restart."""
        if _listener_shape(config) != _listener_shape(self.config):
            log.error("config change refused: listener/ports changes need a restart")
            return False
        self.config = config
        self.datastore.apply_config(config)
        self.director.apply_config(config)
        self.collector.refresh()
        self.write_eds()
        log.info("config applied: pools=%s", ",".join(self.datastore.pools))
        return True

    def membership_changed(self, pool_name: str) -> None:
        """Discovery changed a pool's pods: tell Envoy (the collector follows by itself)."""
        pool = self.datastore.pools.get(pool_name)
        if pool is not None:
            write_endpoints(self.eds_dir, pool.cluster_name, pool.members())

    async def _watch_config(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(RELOAD_POLL_S)
            mtime = _mtime(self.config_path)
            if mtime != self._config_mtime:
                self._config_mtime = mtime
                self.reload()

    async def stop(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Stop taking new streams, let open ones (in-flight requests) finish."""
        self._stopping.set()
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        if (discovery := getattr(self, "_discovery", None)) is not None:
            await discovery.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=drain_timeout)
        if self._admin is not None:
            await self._admin.stop(grace=1.0)
        await self.collector.stop()
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


def _mtime(path: Path) -> float:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mtime
    return 0.0


def _listener_shape(config: GatewayConfig) -> tuple[object, ...]:
    return (
        config.listen_address,
        config.listen_port,
        config.picker_port,
        config.admin_port,
        config.metrics_port,
        config.envoy_admin_port,
        config.failure_mode,
    )
