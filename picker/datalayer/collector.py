"""Background scraping of every pod's `/metrics` into the pool columns.

One asyncio task per pod, so a pod that hangs until its timeout never delays
the others; a supervisor task notices pools and pods that come and go (via
`Pool.version` and the datastore's pool set) and starts or cancels pod tasks
without a restart. All HTTP goes through one `aiohttp.ClientSession` whose
connector keeps one keep-alive connection per pod (`limit_per_host=1`).

A scrape that fails in any way (refused, timed out, non-200, oversized,
garbled) marks the row not ok and leaves its last numbers in place; the row
becomes usable again on the next good scrape. Failing pods are retried with
a capped backoff so a dead fleet does not turn into a connection storm.

Pools whose config says `metrics.source: prometheus` are handed to
`PrometheusPoolSource`, which writes the same columns from PromQL answers.

With `sharing` set (coordinated gateway replicas, picker.coordination.scrapes)
each pod task asks it before every scrape whether this replica should scrape
the pod at all (another replica may be scraping it and sharing the numbers),
and tells it every outcome; the shared results come in through
`apply_shared`, which writes a row exactly as a local scrape does.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from contract.config import MetricsConfig
from picker.cancellation import cancel_and_wait
from picker.datalayer.columns import write_outcome
from picker.datalayer.engines import profile_for
from picker.datalayer.parser import MetricsParseError, MetricsSnapshot, parser_for
from picker.datalayer.prometheus_source import PrometheusPoolSource, PrometheusSourceOptions
from picker.datalayer.speed import DEFAULT_ALPHA, SpeedLearner
from picker.datalayer.stats import ScrapeCounters
from picker.datastore import Datastore, Pod, Pool

log = logging.getLogger(__name__)

MAX_BACKOFF_EXPONENT = 16
FIRST_SCRAPE_SPREAD_S = 0.1


class ScrapeError(Exception):
    """A scrape answered, but not with a usable page (status, size)."""


@dataclass(frozen=True)
class CollectorOptions:
    """Knobs that are not per-pool config; defaults suit a 50 ms scrape interval."""

    jitter: float = 0.1  # ± fraction of the interval, so pods do not scrape in lockstep
    max_backoff_s: float = 1.0  # failing pods are retried at most this far apart
    max_body_bytes: int = 8 * 1024 * 1024
    reconcile_interval_s: float = 0.1  # how soon a joined or left pod is noticed
    alpha: float = DEFAULT_ALPHA
    accept_gzip: bool = False  # identity is cheaper in CPU; gzip saves bandwidth at scale
    stop_timeout_s: float = 5.0
    prometheus: PrometheusSourceOptions = field(default_factory=PrometheusSourceOptions)


class ScrapeSharing(Protocol):
    """Who scrapes which pod when gateway replicas share scrape results.

    Asked before every scrape, told after every one; implemented by
    picker.coordination.scrapes (the data layer knows nothing of replicas).
    """

    def should_scrape(self, pool: Pool, pod: Pod, now: float) -> bool:
        """False while another replica's fresh results keep the pod's row."""
        ...

    def scraped(self, pool: Pool, pod: Pod, snapshot: MetricsSnapshot | None, error: str,
                now: float) -> None:
        """This replica scraped `pod` at monotonic `now` (snapshot None: it failed)."""
        ...

    def forget(self, pool: str, address: str) -> None:
        """The pod left: drop what is kept about it."""
        ...


def backoff_delay(metrics: MetricsConfig, failures: int, options: CollectorOptions) -> float:
    """The time between two scrapes before jitter: the interval, doubled per failure, capped.

    The cap is `max_backoff_s` or half the pool's stale window, whichever is
    shorter (never below the interval): a pod that comes back is seen again
    well within the freshness the pool asks for.
    """
    base = metrics.interval_s
    if failures > 0:
        cap = min(options.max_backoff_s, max(base, metrics.stale_after_s / 2))
        backed_off = base * 2 ** min(failures, MAX_BACKOFF_EXPONENT)
        base = max(base, min(backed_off, cap))
    return base


def next_delay(metrics: MetricsConfig, failures: int, options: CollectorOptions,
               rand: random.Random) -> float:
    """Sleep before the next scrape: `backoff_delay` with ± `jitter`."""
    base = backoff_delay(metrics, failures, options)
    return max(0.0, base * (1.0 + rand.uniform(-options.jitter, options.jitter)))


@dataclass
class _PodTask:
    pool: Pool
    pod: Pod
    task: asyncio.Task[None]


@dataclass
class _PoolState:
    """What the supervisor last saw of a pool, to act only on changes."""

    pool: Pool
    version: int = -1
    source: str = ""
    prometheus_url: str | None = None
    prometheus_task: asyncio.Task[None] | None = None
    prometheus: PrometheusPoolSource | None = None


class MetricsCollector:
    """Keeps every pool's scraped columns current; `start()` then `await stop()`."""

    def __init__(self, datastore: Datastore, *, options: CollectorOptions | None = None,
                 counters: ScrapeCounters | None = None,
                 session: aiohttp.ClientSession | None = None) -> None:
        self.datastore = datastore
        self.options = options or CollectorOptions()
        self.counters = counters or ScrapeCounters()
        self.learner = SpeedLearner(self.options.alpha)
        self._session = session
        self._own_session = session is None
        self._pools: dict[int, _PoolState] = {}
        self._pods: dict[tuple[int, str], _PodTask] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._rand = random.Random()
        # Set while coordinated replicas share scrape results (None: scrape every pod).
        self.sharing: ScrapeSharing | None = None

    # lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        """Begin collecting; call from inside the running event loop."""
        if self._supervisor is not None:
            return
        if self._session is None:
            self._session = make_session(self.options)
        self.reconcile()
        self._supervisor = asyncio.get_running_loop().create_task(
            self._supervise(), name="metrics-collector")

    async def stop(self) -> None:
        """Cancel every task and close what `start()` opened; bounded by `stop_timeout_s`."""
        tasks = [t for t in (self._supervisor,) if t is not None]
        tasks += [p.task for p in self._pods.values()]
        tasks += [s.prometheus_task for s in self._pools.values() if s.prometheus_task]
        await cancel_and_wait(tasks, self.options.stop_timeout_s)
        for state in self._pools.values():
            if state.prometheus is not None:
                state.prometheus.close()
        self._pods.clear()
        self._pools.clear()
        self._supervisor = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def refresh(self) -> None:
        """Act on a config reload now instead of at the next supervisor tick."""
        if self._supervisor is not None:
            self.reconcile()

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self._session

    # supervision -------------------------------------------------------------

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.options.reconcile_interval_s)
            try:
                self.reconcile()
            except Exception:  # a bug here must not end collection for every pool
                log.exception("metrics collector: reconcile failed")

    def reconcile(self) -> None:
        """Match running tasks to the datastore's current pools, pods and sources."""
        pools = {id(p): p for p in self.datastore.pools.values()}
        for key in [k for k in self._pools if k not in pools]:
            self._drop_pool(key)
        for key, pool in pools.items():
            state = self._pools.get(key)
            if state is None:
                state = self._pools[key] = _PoolState(pool)
            metrics = pool.config.metrics
            if state.source != metrics.source or state.prometheus_url != metrics.prometheus_url:
                self._switch_source(key, state, metrics)
            if metrics.source == "scrape" and state.version != pool.version:
                self._sync_pods(key, pool)
                state.version = pool.version

    def _switch_source(self, key: int, state: _PoolState, metrics: MetricsConfig) -> None:
        self._stop_prometheus(state)
        self._stop_pod_tasks(key)
        state.source = metrics.source
        state.prometheus_url = metrics.prometheus_url
        state.version = -1
        if metrics.source == "prometheus":
            source = PrometheusPoolSource(state.pool, counters=self.counters, learner=self.learner,
                                          options=self.options.prometheus)
            state.prometheus = source
            state.prometheus_task = asyncio.get_running_loop().create_task(
                source.run(), name=f"prometheus-source-{state.pool.name}")

    def _sync_pods(self, key: int, pool: Pool) -> None:
        for (pool_key, address), entry in list(self._pods.items()):
            if pool_key == key and pool.pods.get(address) is not entry.pod:
                self._stop_pod(pool_key, address)
        loop = asyncio.get_running_loop()
        for address, pod in pool.pods.items():
            if (key, address) not in self._pods:
                task = loop.create_task(self._pod_loop(pool, pod), name=f"scrape-{address}")
                self._pods[(key, address)] = _PodTask(pool, pod, task)

    def _stop_pod(self, key: int, address: str) -> None:
        entry = self._pods.pop((key, address), None)
        if entry is not None:
            entry.task.cancel()
            self.counters.forget(entry.pool.name, address)
            if self.sharing is not None:
                self.sharing.forget(entry.pool.name, address)

    def _stop_pod_tasks(self, key: int) -> None:
        for pool_key, address in [k for k in self._pods if k[0] == key]:
            self._stop_pod(pool_key, address)

    def _stop_prometheus(self, state: _PoolState) -> None:
        if state.prometheus_task is not None:
            state.prometheus_task.cancel()
        if state.prometheus is not None:
            state.prometheus.close()
            for address in state.prometheus.tracked():
                self.counters.forget(state.pool.name, address)
        state.prometheus_task = None
        state.prometheus = None

    def _drop_pool(self, key: int) -> None:
        state = self._pools.pop(key)
        self._stop_prometheus(state)
        self._stop_pod_tasks(key)
        if not any(s.pool.name == state.pool.name for s in self._pools.values()):
            self.counters.forget_pool(state.pool.name)

    # scraping ----------------------------------------------------------------

    async def _pod_loop(self, pool: Pool, pod: Pod) -> None:
        """Scrape one pod until cancelled. The first scrape is spread over at most
        `FIRST_SCRAPE_SPREAD_S` (not a whole interval): a new pod cannot be picked
        until it is scraped once, so a long interval must not keep it out that long."""
        spread = min(pool.config.metrics.interval_s, FIRST_SCRAPE_SPREAD_S)
        await asyncio.sleep(self._rand.uniform(0.0, spread))
        failures = 0
        while True:
            if self._wants_scrape(pool, pod):
                try:
                    ok = await self.scrape_once(pool, pod)
                except Exception as exc:  # a bug must cost one scrape, not the pod's task
                    log.exception("metrics collector: scrape of %s failed", pod.address)
                    ok = self._record_crash(pool, pod, exc)
                failures = 0 if ok else failures + 1
            else:  # another replica's shared results keep the row; ours restart afresh
                failures = 0
            await asyncio.sleep(next_delay(pool.config.metrics, failures, self.options,
                                           self._rand))

    def _wants_scrape(self, pool: Pool, pod: Pod) -> bool:
        """Scrape now unless sharing says another replica's fresh results cover the pod;
        a bug there scrapes (routing must never go blind)."""
        sharing = self.sharing
        if sharing is None:
            return True
        try:
            return sharing.should_scrape(pool, pod, time.monotonic())
        except Exception:
            log.exception("metrics collector: scrape sharing failed for %s", pod.address)
            return True

    async def scrape_once(self, pool: Pool, pod: Pod) -> bool:
        """One scrape of one pod, written into its row; True if it was good."""
        metrics = pool.config.metrics
        started = time.perf_counter()
        snapshot: MetricsSnapshot | None = None
        error = ""
        try:
            async with asyncio.timeout(metrics.timeout_s):
                body = await self._fetch(f"http://{pod.address}{metrics.path}")
            snapshot = parser_for(profile_for(pool.config.engine_type)).parse(body.decode())
        except (aiohttp.ClientError, TimeoutError, OSError, ScrapeError, MetricsParseError,
                UnicodeDecodeError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        duration = time.perf_counter() - started
        if pool.pods.get(pod.address) is not pod:
            return False  # the pod left (and its row may be reused) while we waited
        now = time.monotonic()
        write_outcome(pool, pod.row, snapshot, self.learner, now)
        self.counters.record(pool.name, pod.address, snapshot is not None, duration, error)
        if self.sharing is not None:
            self.sharing.scraped(pool, pod, snapshot, error, now)
        return snapshot is not None

    def apply_shared(self, pool: Pool, pod: Pod, snapshot: MetricsSnapshot | None,
                     at: float) -> None:
        """Another replica's scrape of `pod`, taken at local monotonic time `at`: written
        exactly as this replica's own scrape would be (`counters`, behind
        igw_pod_scrapes_total, count only this replica's own scrapes)."""
        write_outcome(pool, pod.row, snapshot, self.learner, at)

    def _record_crash(self, pool: Pool, pod: Pod, exc: Exception) -> bool:
        if pool.pods.get(pod.address) is pod:
            pool.mark_scrape(pod.row, False)
            self.counters.record(pool.name, pod.address, False, 0.0,
                                 f"internal: {type(exc).__name__}: {exc}"[:200])
        return False

    async def _fetch(self, url: str) -> bytes:
        session = self._session
        if session is None:
            raise ScrapeError("collector not started")
        limit = self.options.max_body_bytes
        async with session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            if resp.content_length is not None:
                if resp.content_length > limit:
                    raise ScrapeError(f"body of {resp.content_length} bytes over {limit}")
                return await resp.read()
            return await _read_bounded(resp, limit)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """A chunked body, refused once it passes `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ScrapeError(f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def make_session(options: CollectorOptions) -> aiohttp.ClientSession:
    """One keep-alive connection per pod, no global cap, no cookies, no proxies from env."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=1, keepalive_timeout=30.0,
                                     ttl_dns_cache=10)
    headers = {"Accept": "text/plain;version=0.0.4",
               "Accept-Encoding": "gzip" if options.accept_gzip else "identity"}
    return aiohttp.ClientSession(connector=connector, headers=headers,
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 timeout=aiohttp.ClientTimeout(total=None), auto_decompress=True)


Collector = MetricsCollector  # the name picker.app uses

__all__ = [
    "Collector",
    "CollectorOptions",
    "MetricsCollector",
    "ScrapeError",
    "ScrapeSharing",
    "backoff_delay",
    "make_session",
    "next_delay",
]
