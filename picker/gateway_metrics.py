"""The gateway's own Prometheus metrics; every name is defined in this file.

Per-request cost is kept to a couple of counter/histogram updates. Everything
per pod (signals, picks, in-flight) is already in the datastore's columns, so
it is read from there when Prometheus scrapes, not counted again per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from picker.datastore import Datastore
from picker.scheduling.flow import committed

if TYPE_CHECKING:
    from picker.coordination import Coordinator
    from picker.coordination.scrapes import SharedScrapes
    from picker.datalayer.stats import ScrapeCounters
    from picker.director import Director
    from picker.tenants.identity import TenantDirectory
    from picker.tenants.limits import Limiter
    from picker.tenants.usage import UsageLedger

PREFIX = "igw"
SCHED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0)

# (column, metric suffix, help) exported per pod from the datastore.
POD_GAUGES = (
    ("waiting", "pod_waiting_requests", "Requests waiting on the pod, as last scraped."),
    ("running", "pod_running_requests", "Requests running on the pod, as last scraped."),
    ("kv_usage", "pod_kv_cache_usage_ratio", "KV-cache use (0..1), as last scraped."),
    ("inflight", "pod_inflight_requests", "Requests the gateway sent that have not ended."),
    ("dispatched", "pod_dispatched_since_scrape", "Requests sent since the last good scrape."),
    ("outstanding_prefill", "pod_outstanding_prefill_tokens", "Prompt tokens sent, unfinished."),
    ("prefill_tps", "pod_prefill_tokens_per_second", "Learned prefill speed."),
    ("decode_step_s", "pod_decode_seconds_per_token", "Learned decode time per output token."),
    ("ttft_s", "pod_observed_ttft_seconds", "Recent mean time to first token on the pod."),
)


class GatewayMetrics:
    """Counters the request path updates, plus a collector over the datastore."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Requests routed to a pod.", ["pool"], registry=r
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors",
            "Requests the gateway answered with an error.",
            ["code"],
            registry=r,
        )
        self.completions = Counter(
            f"{PREFIX}_requests_completed", "Routed requests that ended.", ["pool"], registry=r
        )
        self.shed_total = Counter(
            f"{PREFIX}_requests_shed",
            "Sheddable requests refused (429) on a saturated pool.",
            ["pool"],
            registry=r,
        )
        self.scheduling = Histogram(
            f"{PREFIX}_scheduling_duration_seconds",
            "Time from body received to pick (excluding admission wait).",
            buckets=SCHED_BUCKETS,
            registry=r,
        )
        self.reloads = Counter(
            f"{PREFIX}_config_reloads", "Config changes seen, by result (applied, refused).",
            ["result"], registry=r,
        )
        self._requests_by_pool: dict[str, Counter] = {}
        self._completions_by_pool: dict[str, Counter] = {}

    def attach(
        self, datastore: Datastore, extra: Callable[[], Iterator[Metric]] | None = None
    ) -> None:
        """Export per-pod figures from the datastore (and anything `extra` yields)."""
        self.registry.register(_DatastoreCollector(datastore, extra))

    def attach_routing(self, director: Director, scrapes: ScrapeCounters) -> None:
        """Export admission queues, prefix-affinity outcome and scrape outcomes."""
        self.registry.register(_RoutingCollector(director, scrapes))

    def attach_coordination(self, coordinator: Coordinator) -> None:
        """Export the link to the other gateway replicas (spec.coordination)."""
        self.registry.register(_CoordinationCollector(coordinator))

    def attach_tenants(self, tenants: TenantDirectory, limiter: Limiter | None,
                       ledger: UsageLedger | None = None) -> None:
        """Export per-tenant usage, refused credentials and the limits' state (spec.tenants)."""
        self.registry.register(_TenantCollector(tenants, limiter, ledger))

    def picked(self, pool: str, pod: str, seconds: float) -> None:
        child = self._requests_by_pool.get(pool)
        if child is None:
            child = self._requests_by_pool[pool] = self.requests.labels(pool)
        child.inc()
        self.scheduling.observe(seconds)

    def completed(self, pool: str, status: int) -> None:
        child = self._completions_by_pool.get(pool)
        if child is None:
            child = self._completions_by_pool[pool] = self.completions.labels(pool)
        child.inc()

    def rejected(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def shed(self, pool: str) -> None:
        self.shed_total.labels(pool).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _DatastoreCollector(Collector):
    """Reads the pod columns at scrape time."""

    def __init__(self, datastore: Datastore, extra: Callable[[], Iterator[Metric]] | None) -> None:
        self.datastore = datastore
        self.extra = extra

    def collect(self) -> Iterator[Metric]:
        # `pod` is the pod's name: the configured endpoint (a name or ip:port) or,
        # in Kubernetes, whatever discovery named it; stable across IP changes.
        labels = ["pool", "pod"]
        gauges = {
            col: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            for col, name, doc in POD_GAUGES
        }
        picks = CounterMetricFamily(
            f"{PREFIX}_pod_picks", "Requests sent to the pod.", labels=labels
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_pod_metrics_age_seconds",
            "Seconds since the pod's last good scrape.",
            labels=labels,
        )
        fresh = GaugeMetricFamily(
            f"{PREFIX}_pod_ready",
            "1 when the pod can receive requests (ready, metrics ok).",
            labels=labels,
        )
        now = time.monotonic()
        for pool in self.datastore.pools.values():
            t = pool.table
            for pod in pool.pods.values():
                row, lv = pod.row, [pool.name, pod.name]
                for col, gauge in gauges.items():
                    gauge.add_metric(lv, float(getattr(t, col)[row]))
                picks.add_metric(lv, float(t.picks[row]))
                scraped = t.scraped_at[row]
                age.add_metric(lv, now - scraped if scraped > 0 else float("inf"))
                ok = t.valid[row] and t.ready[row] and t.metrics_ok[row] and not t.draining[row]
                fresh.add_metric(lv, 1.0 if ok else 0.0)
        yield from gauges.values()
        yield from (picks, age, fresh)
        if self.extra is not None:
            yield from self.extra()


class _RoutingCollector(Collector):
    """Per-pool routing state and per-pod scrape outcomes, read at scrape time."""

    def __init__(self, director: Director, scrapes: ScrapeCounters) -> None:
        self.director = director
        self.scrapes = scrapes

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(
            f"{PREFIX}_admission_queue_length", "Requests waiting in the gateway's admission "
            "queue for room in the pool (saturated, or full by flow control).", labels=["pool"],
        )
        index = GaugeMetricFamily(
            f"{PREFIX}_prefix_index_blocks", "Prompt blocks held in the pool's prefix-affinity "
            "index (all pods).", labels=["pool"],
        )
        shared = GaugeMetricFamily(
            f"{PREFIX}_prefix_shared_tokens", "Prompt prefix tokens the pool's requests of "
            "the last minute shared (as of the latest request), summed over prefixes: what "
            "each pod would hold to hold them all (prefix affinity is not voted where it is "
            "under a tenth of the pool's smallest KV cache).", labels=["pool"],
        )
        queried = CounterMetricFamily(
            f"{PREFIX}_prefix_query_blocks", "Prompt blocks of routed requests.", labels=["pool"]
        )
        hit = CounterMetricFamily(
            f"{PREFIX}_prefix_hit_blocks", "Prompt blocks the chosen pod was last sent "
            "(hit ratio = hit / query).", labels=["pool"],
        )
        # What an autoscaler reads (picker.scheduling.flow): work committed to the pool
        # beside the queue above; a saturation of 1 or more means new requests wait.
        pool_table = (
            ("pool_committed_requests", "requests", "Requests the gateway sent to the pool "
             "that have not ended (all replicas' when coordinated)."),
            ("pool_committed_prefill_tokens", "prefill_tokens", "Uncached prompt tokens sent "
             "to the pool and not prefilled yet, as far as the gateway can tell."),
            ("pool_saturation", "saturation", "Share of the pool's capacity in use: committed "
             "prefill time over saturation.maxStartDelay, or the share of pods saturated by "
             "their engine queue or KV cache, whichever is larger (1 or more: requests wait)."),
        )
        pool_gauges = []
        for suffix, field_name, doc in pool_table:
            family = GaugeMetricFamily(f"{PREFIX}_{suffix}", doc, labels=["pool"])
            pool_gauges.append((field_name, family))
        now = time.monotonic()
        for name, sched in self.director.schedulers.items():
            q = self.director.admission.get(name)
            queue.add_metric([name], float(len(q)) if q is not None else 0.0)
            index.add_metric([name], float(len(sched.state.prefix)))
            shared.add_metric([name], float(sched.state.footprint.tokens))
            queried.add_metric([name], float(sched.state.prefix_query_blocks))
            hit.add_metric([name], float(sched.state.prefix_hit_blocks))
            work = committed(sched.state, now)
            for field_name, family in pool_gauges:
                family.add_metric([name], getattr(work, field_name))
        scrapes = CounterMetricFamily(
            f"{PREFIX}_pod_scrapes", "Metrics scrapes of each pod, by outcome.",
            labels=["pool", "pod", "outcome"],
        )
        duration = GaugeMetricFamily(
            f"{PREFIX}_pod_scrape_duration_seconds", "Duration of the pod's last scrape.",
            labels=["pool", "pod"],
        )
        pools = self.director.datastore.pools
        for pool_name, address, stats in self.scrapes.items():
            pool = pools.get(pool_name)
            pod = pool.pods.get(address) if pool is not None else None
            name = pod.name if pod is not None else address
            scrapes.add_metric([pool_name, name, "ok"], float(stats.ok))
            scrapes.add_metric([pool_name, name, "failed"], float(stats.failed))
            duration.add_metric([pool_name, name], stats.last_duration_s)
        yield queue
        yield from (family for _, family in pool_gauges)
        yield from (index, shared, queried, hit, scrapes, duration)


class _CoordinationCollector(Collector):
    """The coordination link's state and counters (picker.coordination), read at scrape time."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        c = self.coordinator
        s = c.stats
        now = time.monotonic()
        name = f"{PREFIX}_coordination"
        gauges = (
            ("connected", "1 while this replica's link to the shared Redis is up.",
             1.0 if s.connected else 0.0),
            ("live_replicas", "Gateway replicas heard within replicaTimeout, this one "
             "included.", float(len(c.replicas.live(now)) + 1)),
            ("remote_inflight_requests", "Other replicas' requests counted in this "
             "replica's in-flight state.", float(c.replicas.outstanding())),
            ("lag_seconds", "Age of the newest remote batch folded, on the Redis server's clock "
             "(picker.coordination.clock).", s.lag_s),
            ("buffered_events", "Events waiting to be sent.", float(len(c.outbox))),
        )
        for suffix, doc, value in gauges:
            gauge = GaugeMetricFamily(f"{name}_{suffix}", doc)
            gauge.add_metric([], value)
            yield gauge
        counters = (
            ("batches_sent", "Batches (stream entries) this replica sent.", s.batches_sent),
            ("events_sent", "Dispatches and completions this replica sent.", s.events_sent),
            ("batches_received", "Remote batches folded.", s.batches_received),
            ("events_received", "Remote dispatches and completions folded.",
             s.events_received),
            ("reconnects", "Times the link was lost after being up.", s.reconnects),
            ("decode_errors", "Remote entries that were not a readable batch.",
             s.decode_errors),
            ("unresolved_events", "Remote dispatches and scrape results naming a pool or "
             "pod unknown here.",
             c.folder.unresolved),
            ("released_requests", "Remote requests released without their completion "
             "(their replica died, or the completion never came).",
             c.replicas.released_dead + c.replicas.released_aged),
        )
        for suffix, doc, value in counters:
            counter = CounterMetricFamily(f"{name}_{suffix}", doc)
            counter.add_metric([], float(value))
            yield counter
        dropped = CounterMetricFamily(
            f"{name}_dropped_events", "Events never sent, by reason (buffer_full: the oldest "
            "dropped while Redis was slow or down; send_failed: their batch's send failed).",
            labels=["reason"],
        )
        dropped.add_metric(["buffer_full"], float(c.outbox.dropped))
        dropped.add_metric(["send_failed"], float(s.send_failed))
        yield dropped
        if c.scrapes is not None:
            yield from _scrape_sharing(s.scrapes_sent, c.scrapes)


def _scrape_sharing(sent: int, scrapes: SharedScrapes) -> Iterator[Metric]:
    """Shared scrape results (spec.coordination.shareScrapes); this replica's own scrapes
    stay in igw_pod_scrapes_total."""
    # spelled out here, not passed in: the dashboard tests read the names from this source
    name = f"{PREFIX}_coordination"
    pods = GaugeMetricFamily(
        f"{name}_scrape_pods", "Pods by who scrapes them for this replica: owner (this "
        "replica, sharing the results), shared (their owner; results received), fallback "
        "(this replica, as the owner's results are not arriving fresh).", labels=["role"],
    )
    for role, count in scrapes.roles().items():
        pods.add_metric([role], float(count))
    yield pods
    st = scrapes.stats
    received = CounterMetricFamily(
        f"{name}_shared_scrapes_received", "Other replicas' scrape results for pods known "
        "here, by result (used: written into the pod's row; ignored: older than the row's "
        "last scrape, or a pod this replica owns).", labels=["result"],
    )
    received.add_metric(["used"], float(st.used))
    received.add_metric(["ignored"], float(st.ignored))
    yield received
    counters = (
        ("shared_scrapes_sent", "Scrape results this replica shared as the pods' owner.",
         sent),
        ("scrapes_skipped", "Scrapes this replica did not make: the owner's fresh result "
         "covered the pod.", st.skipped),
        ("scrape_fallbacks", "Scrapes this replica made of a pod another replica owns, its "
         "results not arriving fresh.", st.fallbacks),
    )
    for suffix, doc, value in counters:
        counter = CounterMetricFamily(f"{name}_{suffix}", doc)
        counter.add_metric([], float(value))
        yield counter


class _TenantCollector(Collector):
    """Per-tenant usage, labelled by configured tenants only (the label set is bounded by
    the config, never by what clients send), read at scrape time from plain counters.

    Output tokens arrive after each response ended, from Envoy's access log
    (picker.tenants.usage).
    """

    def __init__(self, tenants: TenantDirectory, limiter: Limiter | None,
                 ledger: UsageLedger | None) -> None:
        self.tenants = tenants
        self.limiter = limiter
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        name = f"{PREFIX}_tenant"
        usage = (
            ("requests", "Requests of the tenant its limits admitted.", "requests"),
            ("prompt_tokens", "Prompt tokens (estimated, ~4 characters each) of admitted "
             "requests.", "prompt_tokens"),
            ("reserved_tokens", "Tokens reserved against tokensPerMinute: prompt tokens plus "
             "max_tokens.", "reserved_tokens"),
            ("rate_limited", "Requests refused with 429 rate_limit_exceeded.", "rate_limited"),
            ("output_tokens", "Output tokens of the tenant's answered requests, counted by "
             "Envoy from each response and reported after it ended.", "output_tokens"),
            ("output_tokens_estimated", "The part of output_tokens counted from a stream's "
             "events because the stream carried no usage object (an estimate).",
             "output_tokens_estimated"),
        )
        tenants = list(self.tenants.tenants.values())
        for suffix, doc, attr in usage:
            family = CounterMetricFamily(f"{name}_{suffix}", doc, labels=["tenant"])
            for tenant in tenants:
                family.add_metric([tenant.name], float(getattr(tenant.usage, attr)))
            yield family
        s = self.tenants.stats
        refused = CounterMetricFamily(
            f"{name}_unauthorized", "Requests refused with 401, by reason (missing: no "
            "credential; invalid: not a key or no such key; unknown_tenant: a key or claim "
            "naming no configured tenant).", labels=["reason"],
        )
        for reason in ("missing", "invalid", "unknown_tenant"):
            refused.add_metric([reason], float(getattr(s, reason)))
        yield refused
        if self.ledger is not None:
            unmeasured = CounterMetricFamily(
                f"{name}_usage_unmeasured", "Routed tenant requests whose output tokens never "
                "came (not a 200, the client left mid-stream): their reservation stands.",
            )
            unmeasured.add_metric([], float(self.ledger.unmeasured))
            yield unmeasured
        keys = GaugeMetricFamily(f"{name}_keys", "API keys loaded from the keys file.")
        keys.add_metric([], float(s.keys))
        yield keys
        reloads = CounterMetricFamily(
            f"{name}_key_reloads", "Keys file reads, by result (refused: the keys in force "
            "stay).", labels=["result"],
        )
        reloads.add_metric(["applied"], float(s.reloads_applied))
        reloads.add_metric(["refused"], float(s.reloads_refused))
        yield reloads
        if self.limiter is not None:
            yield from limits_state(self.limiter)


class _LimitsCollector(Collector):
    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    def collect(self) -> Iterator[Metric]:
        yield from limits_state(self.limiter)


def limits_text(limiter: Limiter) -> str:
    """The limiter's series alone, as Prometheus text (the global router's /metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LimitsCollector(limiter))
    return generate_latest(registry).decode()


def limits_state(limiter: Limiter) -> Iterator[Metric]:
    """The limiter's link to the shared Redis and what it refused (the global router's
    /metrics serves the same series)."""
    status = limiter.status()
    name = f"{PREFIX}_tenant_limits"
    shared = GaugeMetricFamily(
        f"{name}_shared", "1 while the limits' counts are exchanged with the other replicas "
        "through Redis; 0 when each replica counts alone (no coordination, or Redis down).",
    )
    shared.add_metric([], 1.0 if status["mode"] == "shared" else 0.0)
    yield shared
    degraded = GaugeMetricFamily(
        f"{name}_degraded", "1 while Redis is expected but unreachable and failureMode "
        "applies (open: this replica's share of each limit; closed: 503).",
    )
    degraded.add_metric([], 1.0 if status["redis"] == "down" else 0.0)
    yield degraded
    replicas = GaugeMetricFamily(
        f"{name}_replicas", "Gateway replicas sharing the limits, this one included."
    )
    replicas.add_metric([], float(status["replicas"]))
    yield replicas
    refused = CounterMetricFamily(
        f"{name}_refused", "Requests the limits refused, by limit (requests, tokens, "
        "concurrency: 429; unavailable: 503 under failureMode closed).", labels=["limit"],
    )
    for limit, count in status["refused"].items():
        refused.add_metric([limit], float(count))
    yield refused
    errors = CounterMetricFamily(f"{name}_sync_errors", "Failed exchanges with Redis.")
    errors.add_metric([], float(status.get("sync_errors", 0)))
    yield errors


def process_families(ejected_pods: int) -> Iterator[Metric]:
    """The picker process's own health: leak watch and Envoy's outlier ejections."""
    tasks = GaugeMetricFamily(
        f"{PREFIX}_picker_asyncio_tasks", "asyncio tasks alive in the picker process."
    )
    tasks.add_metric([], float(len(asyncio.all_tasks())))
    yield tasks
    fds = GaugeMetricFamily(f"{PREFIX}_picker_open_fds", "Open file descriptors.")
    with contextlib.suppress(OSError):
        fds.add_metric([], float(len(os.listdir("/proc/self/fd"))))
    yield fds
    ejected = GaugeMetricFamily(
        f"{PREFIX}_pods_ejected", "Pods Envoy's outlier detection currently ejects."
    )
    ejected.add_metric([], float(ejected_pods))
    yield ejected
