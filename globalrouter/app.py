"""The global router process: ext_proc for Envoy, the summary poller, status over HTTP.

The transport is the Tier-1 picker's (picker.h2_grpc, picker.handlers): the
same one-message ext_proc route, the same error answers, the same gRPC health
check Envoy and `igw global serve` use. The HTTP port serves `/healthz`,
`/regions` (what the router knows of every region: freshness, RTT, its
summary; `igw global status` prints it) and `/metrics` (Prometheus text).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from aiohttp import web
from grpc_health.v1 import health_pb2

from contract.global_config import GlobalRouterConfig, load_global_config
from globalrouter.director import GlobalDirector
from globalrouter.poller import SummaryPoller
from globalrouter.regions import RegionTable
from globalrouter.reload import GlobalConfigReloader
from globalrouter.session_sync import SessionSync
from picker.app import (
    EXT_PROC_PATH,
    HEALTH_SERVICES,
    MAX_EXT_PROC_MESSAGE,
    serve_until_signalled,
)
from picker.cancellation import cancel_and_wait
from picker.coordination.bus import BusError, client_factory
from picker.coordination.replicas import default_replica_id
from picker.gateway_metrics import limits_text
from picker.h2_grpc import HEALTH_CHECK_PATH, H2GrpcServer, HealthCheck
from picker.handlers import ExtProcHandler
from picker.tenants.limits import Limiter

log = logging.getLogger("globalrouter.app")

DRAIN_TIMEOUT_S = 30.0
METRICS_PREFIX = "igw_global"


class GlobalRouterApp:
    """Owns every long-lived part of the global router process."""

    def __init__(self, config_path: Path, host: str = "127.0.0.1",
                 metrics_host: str | None = None) -> None:
        self.config: GlobalRouterConfig = load_global_config(config_path)
        self.host = host
        # The HTTP port (/metrics, /regions, /healthz) may face the pod network for a
        # Prometheus scrape; ext_proc stays on `host` (it decides where traffic goes).
        self.metrics_host = metrics_host or host
        self.table = RegionTable(self.config)
        tenants = self.config.tenants
        self.limiter = Limiter(failure_mode=tenants.failure_mode) if tenants is not None else None
        self.director = GlobalDirector(self.config, self.table, self.limiter)
        self.poller = SummaryPoller(self.config, self.table)
        self.reloader = GlobalConfigReloader(self.config, config_path, self._adopt)
        self._grpc: H2GrpcServer | None = None
        self._http: web.AppRunner | None = None
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def key_prefix(self) -> str:
        """The tenant limits' keys in the shared Redis: one set per global router."""
        coordination = self.config.coordination
        if coordination is not None and coordination.key_prefix:
            return coordination.key_prefix
        return f"igw-global:{self.config.namespace}:{self.config.name}"

    def _adopt(self, config: GlobalRouterConfig) -> None:
        """Every part to a reloaded config (globalrouter.reload decided it may)."""
        self.config = config
        self.table.reconfigure(config)
        self.poller.config = config
        self.director.reconfigure(config)

    async def start(self) -> None:
        self.poller.start()
        watch = self.reloader.watch(self._stopping)
        self._tasks.append(asyncio.create_task(watch, name="global-config-watch"))
        if self.limiter is not None:
            await self.limiter.start_shared(self.config.coordination, self.key_prefix)
            keys = self.director.tenants.watch(self._stopping)
            self._tasks.append(asyncio.create_task(keys, name="global-tenant-keys"))
        await self._start_session_sync()
        handler = ExtProcHandler(self.director)
        self._grpc = H2GrpcServer(
            {
                EXT_PROC_PATH: handler.stream,
                HEALTH_CHECK_PATH: lambda stream: HealthCheck(stream, self._serving),
            },
            max_message=MAX_EXT_PROC_MESSAGE,
        )
        await self._grpc.start(self.host, self.config.picker_port)
        self._http = await self._start_http()
        log.info("global router serving ext_proc=%s:%d http=%s:%d regions=%s", self.host,
                 self.config.picker_port, self.metrics_host, self.config.metrics_port,
                 ",".join(self.table.names))

    async def _start_session_sync(self) -> None:
        """With spec.coordination (and sessions on): share session bindings with the other
        replicas (globalrouter.session_sync). A password that cannot be read is logged and
        sessions stay this replica's, as the tenant limits do."""
        settings = self.config.coordination
        if settings is None or self.config.affinity.max_sessions == 0:
            return
        try:
            clients = client_factory(settings, 1)
        except BusError as exc:
            log.error("sessions not shared (each replica keeps its own): %s", exc)
            return
        sync = SessionSync(self.director.affinity, self.table.names, clients, self.key_prefix,
                           default_replica_id())
        await sync.start()
        self.director.session_sync = sync

    def _serving(self, service: str) -> int | None:
        if service not in HEALTH_SERVICES:
            return None
        if self._stopping.is_set():
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def _start_http(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/healthz", self._serve_health)
        app.router.add_get("/regions", self._serve_regions)
        app.router.add_get("/metrics", self._serve_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.metrics_host, self.config.metrics_port).start()
        return runner

    async def _serve_health(self, _request: web.Request) -> web.Response:
        serving = not self._stopping.is_set()
        return web.Response(text="ok" if serving else "draining", status=200 if serving else 503)

    async def _serve_regions(self, _request: web.Request) -> web.Response:
        doc = {"regions": self.table.describe(), "placed": dict(self.director.placed),
               "refused": {str(k): v for k, v in self.director.refused.items()},
               "config": {"lastReload": self.reloader.last,
                          "drained": [r.name for r in self.config.regions if r.drain]},
               "affinity": {**self.director.affine, "sessions": self.director.affinity.sessions,
                            "prefixBlocks": self.director.affinity.prefix_blocks}}
        if self.director.session_sync is not None:
            doc["sessionSync"] = self.director.session_sync.stats()
        if self.limiter is not None:
            doc["tenantLimits"] = self.limiter.status()
        return web.json_response(doc)

    async def _serve_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    def metrics_text(self) -> str:
        """Prometheus text: per region freshness, RTT, placements; refusals by status."""
        now = time.monotonic()
        fresh = self.table.fresh(now)
        lines = [
            f"# HELP {METRICS_PREFIX}_region_fresh 1 when the region's load summary is fresh.",
            f"# TYPE {METRICS_PREFIX}_region_fresh gauge",
        ]
        lines += [f'{METRICS_PREFIX}_region_fresh{{region="{n}"}} {int(fresh[i])}'
                  for i, n in enumerate(self.table.names)]
        suspect = self.table.suspect(now)
        lines += [f"# HELP {METRICS_PREFIX}_region_suspect 1 when the region's last poll failed "
                  "or was slow, or its poll is overdue: placed after the others.",
                  f"# TYPE {METRICS_PREFIX}_region_suspect gauge"]
        lines += [f'{METRICS_PREFIX}_region_suspect{{region="{n}"}} {int(suspect[i])}'
                  for i, n in enumerate(self.table.names)]
        lines += [f"# HELP {METRICS_PREFIX}_region_rtt_seconds Median RTT of recent polls.",
                  f"# TYPE {METRICS_PREFIX}_region_rtt_seconds gauge"]
        lines += [f'{METRICS_PREFIX}_region_rtt_seconds{{region="{n}"}} {self.table.rtt_s[i]:.6f}'
                  for i, n in enumerate(self.table.names)]
        lines += [f"# HELP {METRICS_PREFIX}_placed_total Requests placed, by first region.",
                  f"# TYPE {METRICS_PREFIX}_placed_total counter"]
        lines += [f'{METRICS_PREFIX}_placed_total{{region="{n}"}} {self.director.placed[n]}'
                  for n in self.table.names]
        lines += [f"# HELP {METRICS_PREFIX}_refused_total Requests answered by the router.",
                  f"# TYPE {METRICS_PREFIX}_refused_total counter"]
        lines += [f'{METRICS_PREFIX}_refused_total{{status="{s}"}} {c}'
                  for s, c in sorted(self.director.refused.items())]
        lines += self._affinity_lines()
        lines += [f"# HELP {METRICS_PREFIX}_config_reloads_total Config reloads, by result.",
                  f"# TYPE {METRICS_PREFIX}_config_reloads_total counter"]
        lines += [f'{METRICS_PREFIX}_config_reloads_total{{result="{r}"}} '
                  f'{self.reloader.results[r]}' for r in ("applied", "refused")]
        return "\n".join(lines) + "\n" + self._limits_text()

    def _affinity_lines(self) -> list[str]:
        """What session and prefix affinity did, and how much they hold (bounded)."""
        affinity = self.director.affinity
        lines = [f"# HELP {METRICS_PREFIX}_affinity_total Placements affinity decided: session "
                 "(kept in its region), moved (its region no longer qualified), prefix (the "
                 "first region holds part of the prompt).",
                 f"# TYPE {METRICS_PREFIX}_affinity_total counter"]
        lines += [f'{METRICS_PREFIX}_affinity_total{{kind="{k}"}} {self.director.affine[k]}'
                  for k in ("session", "moved", "prefix")]
        lines += [f"# HELP {METRICS_PREFIX}_affinity_sessions Sessions remembered.",
                  f"# TYPE {METRICS_PREFIX}_affinity_sessions gauge",
                  f"{METRICS_PREFIX}_affinity_sessions {affinity.sessions}",
                  f"# HELP {METRICS_PREFIX}_affinity_prefix_blocks Prompt blocks remembered, "
                  "over all regions.",
                  f"# TYPE {METRICS_PREFIX}_affinity_prefix_blocks gauge",
                  f"{METRICS_PREFIX}_affinity_prefix_blocks {affinity.prefix_blocks}"]
        sync = self.director.session_sync
        if sync is not None:
            stats = sync.stats()
            lines += [f"# HELP {METRICS_PREFIX}_session_sync_connected 1 while session "
                      "bindings are exchanged with the other replicas through Redis.",
                      f"# TYPE {METRICS_PREFIX}_session_sync_connected gauge",
                      f"{METRICS_PREFIX}_session_sync_connected {int(stats['connected'])}"]
            for name in ("published", "adopted", "errors"):
                lines += [f"# HELP {METRICS_PREFIX}_session_sync_{name}_total Session "
                          f"bindings {name} (errors: failed exchanges).",
                          f"# TYPE {METRICS_PREFIX}_session_sync_{name}_total counter",
                          f"{METRICS_PREFIX}_session_sync_{name}_total {stats[name]}"]
        return lines

    def _limits_text(self) -> str:
        """The tenant limits' igw_tenant_limits_* series, as Tier 1 serves them: whether
        they are shared through Redis, degraded (failureMode applies), with how many
        replicas, what they refused."""
        return limits_text(self.limiter) if self.limiter is not None else ""

    async def stop(self, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        self._stopping.set()
        await cancel_and_wait(self._tasks, timeout_s=5.0)
        if self._grpc is not None:
            await self._grpc.stop(grace=drain_timeout)
        await self.poller.stop()
        if self.limiter is not None:
            await self.limiter.stop()
        if self.director.session_sync is not None:
            await self.director.session_sync.stop()
        if self._http is not None:
            await self._http.cleanup()

    async def run_until_signalled(self) -> None:
        await serve_until_signalled(self.start, self.stop, "global router", self.reloader.reload)
