"""The same pool columns, read from a Prometheus server instead of the pods.

For fleets whose `/metrics` already flow into Prometheus: per pool and cycle,
one instant query per signal (`{__name__=~"<the engine's names>",
instance=~"<the pool's pods>"}`), between two `timestamp(...)` queries that
give the time of each pod's last sample (an instant query reports the
evaluation time, not the sample's) and reveal a pod scraped mid-cycle, whose
answers would mix two scrapes and are left for the next poll. Series are mapped back to
pods by the `instance` label (`host:port`, Prometheus' default) and folded by
the same `SnapshotBuilder` and written by the same `write_snapshot` as the
direct collector, so both sources fill identical columns.

prometheus-api-client is requests-based and blocking: its calls run in a
one-thread executor per pool, with a timeout on every request and no retries,
so the event loop never blocks and a slow Prometheus costs one thread, not
the picker. Staleness follows the sample age: a row's `scraped_at` is set to
when Prometheus took the sample, so `stale_after_s` must exceed the
Prometheus scrape interval. A pod missing from the answer (Prometheus could
not scrape it, so its series went stale) is marked not ok; if Prometheus
itself cannot be reached the rows are left alone and go stale on their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from picker.datalayer.columns import write_snapshot
from picker.datalayer.engines import (
    INFO_SIGNALS,
    EngineProfile,
    Signal,
    profile_for,
    split_key,
)
from picker.datalayer.parser import MetricsParseError, SnapshotBuilder
from picker.datalayer.speed import SpeedLearner
from picker.datalayer.stats import ScrapeCounters
from picker.datastore import Pool

log = logging.getLogger(__name__)

SAMPLED_AT = "sampled_at"  # the sample-time query, asked first ...
SAMPLED_AT_END = "sampled_at_end"  # ... and again last: a change means a scrape landed mid-cycle
_RE2_SPECIAL = frozenset("\\.+*?()|[]{}^$")


class QueryClient(Protocol):
    """The part of `prometheus_api_client.PrometheusConnect` this module uses."""

    def custom_query(self, query: str, params: dict[str, Any] | None = None,
                     timeout: int | float | None = None) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class PrometheusSourceOptions:
    """Settings beyond `MetricsConfig` (`prometheus_url`, `interval_s`, `stale_after_s`)."""

    min_interval_s: float = 0.5  # Prometheus' data changes once per its own scrape interval
    query_timeout_s: float = 2.0
    instance_label: str = "instance"
    selector: str = ""  # extra PromQL matchers, e.g. 'job="vllm"'
    jitter: float = 0.1
    client_factory: Callable[[str, float], QueryClient] | None = field(default=None,
                                                                        compare=False)


def make_client(url: str, timeout_s: float) -> QueryClient:
    """A PrometheusConnect that never retries (retries would unbound the cycle)."""
    try:
        from prometheus_api_client import PrometheusConnect
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "metrics.source: prometheus needs the prometheus-api-client package") from exc
    from urllib3.util.retry import Retry

    no_retry = Retry(total=0, connect=0, read=0, redirect=0, status=0, raise_on_status=False)
    return PrometheusConnect(url=url, disable_ssl=False, retry=no_retry, timeout=timeout_s)


def regex_escape(text: str) -> str:
    """Escape RE2 metacharacters, for a PromQL `=~` matcher inside backticks."""
    return "".join("\\" + c if c in _RE2_SPECIAL else c for c in text)


def build_queries(profile: EngineProfile, addresses: Iterable[str],
                  instance_label: str = "instance", selector: str = "") -> dict[str, str]:
    """One instant query per signal, between two asks of when each pod's sample was taken.

    The queries run one after another, so Prometheus may store a new scrape of
    a pod between two of them; the sample time asked first and last tells
    (see `PodFold.consistent`). Queries run in the returned dict's order.
    Backtick strings are raw in PromQL, so the regexes need no second escaping.
    """
    instances = "|".join(regex_escape(a) for a in sorted(addresses))
    pods = f"{instance_label}=~`{instances}`" + (f",{selector}" if selector else "")
    sampled_at = f"timestamp({signal_selector(profile, Signal.WAITING, pods)})"
    queries: dict[str, str] = {SAMPLED_AT: sampled_at}
    for signal in profile.signals():
        queries[signal.value] = signal_selector(profile, signal, pods)
    queries[SAMPLED_AT_END] = sampled_at
    return queries


def signal_selector(profile: EngineProfile, signal: Signal, pods: str) -> str:
    """Every series of `signal` on the pods matched by `pods`, as one PromQL expression.

    Plain names share one `__name__` regex; a label-selected series
    (`name{label="value"}`) needs its own matcher, so it is a selector of its
    own, joined by `or` (the series differ by name or label, so none is lost).
    """
    plain: list[str] = []
    parts: list[str] = []
    for key in profile.metric_names(signal):
        family, label, value = split_key(key)
        if label is None:
            plain.append(regex_escape(family))
        else:
            parts.append(f"{{__name__=`{family}`,{label}=`{value}`,{pods}}}")
    if plain:
        parts.insert(0, f"{{__name__=~`{'|'.join(plain)}`,{pods}}}")
    return " or ".join(parts)


@dataclass
class PodFold:
    """What the answers said about one pod."""

    builder: SnapshotBuilder
    sampled_at: float = -math.inf
    sampled_at_end: float = -math.inf

    @property
    def consistent(self) -> bool:
        """All answers describe the same scrape of the pod (none landed mid-cycle)."""
        return self.sampled_at == self.sampled_at_end


def fold_answers(profile: EngineProfile, answers: dict[str, list[dict[str, Any]]],
                 instance_label: str = "instance") -> dict[str, PodFold]:
    """Group PromQL vector results by pod and fold them as the text parser would."""
    folds: dict[str, PodFold] = {}
    for key, result in answers.items():
        for item in result:
            labels = item.get("metric", {})
            instance = labels.get(instance_label)
            value = _value(item)
            if instance is None or value is None:
                continue
            fold = folds.get(instance)
            if fold is None:
                fold = folds[instance] = PodFold(SnapshotBuilder(profile))
            if key == SAMPLED_AT:
                fold.sampled_at = max(fold.sampled_at, value)
                continue
            if key == SAMPLED_AT_END:
                fold.sampled_at_end = max(fold.sampled_at_end, value)
                continue
            key = profile.key_of(labels.get("__name__", ""), labels)
            if key is None:
                continue
            if profile.names[key] in INFO_SIGNALS:
                fold.builder.add_info(key, labels, value)
            else:
                fold.builder.add(key, value)
    return folds


def _value(item: dict[str, Any]) -> float | None:
    try:
        return float(item["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _run_queries(client: QueryClient, queries: dict[str, str],
                 timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Runs in the executor thread: the queries one after another."""
    return {key: client.custom_query(query, timeout=timeout_s) for key, query in queries.items()}


class PrometheusPoolSource:
    """Polls Prometheus for one pool until cancelled; `close()` releases its thread."""

    def __init__(self, pool: Pool, *, counters: ScrapeCounters, learner: SpeedLearner,
                 options: PrometheusSourceOptions | None = None) -> None:
        self.pool = pool
        self.counters = counters
        self.learner = learner
        self.options = options or PrometheusSourceOptions()
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=f"prom-{pool.name}")
        self._client: QueryClient | None = None
        self._last_sample: dict[str, float] = {}
        self._seen: set[str] = set()
        self._rand = random.Random()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def tracked(self) -> list[str]:
        """Pods this source has recorded counters for."""
        return list(self._seen)

    def _interval(self) -> float:
        base = max(self.pool.config.metrics.interval_s, self.options.min_interval_s)
        return base * (1.0 + self._rand.uniform(-self.options.jitter, self.options.jitter))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except Exception:  # one bad answer must not end this pool's collection
                log.exception("prometheus source %s: poll failed", self.pool.name)
            await asyncio.sleep(max(0.0, self._interval() - (loop.time() - started)))

    async def poll_once(self) -> None:
        """Query, fold and write every pod of the pool once."""
        pods = dict(self.pool.pods)
        self._last_sample = {a: t for a, t in self._last_sample.items() if a in pods}
        for address in self._seen - pods.keys():  # departed pods: keep the counters bounded
            self.counters.forget(self.pool.name, address)
        self._seen = set(pods)
        if not pods:
            return
        metrics = self.pool.config.metrics
        profile = profile_for(self.pool.config.engine_type)
        queries = build_queries(profile, pods, self.options.instance_label,
                                self.options.selector)
        started = time.perf_counter()
        try:
            answers = await self._query(metrics.prometheus_url or "", queries)
        except Exception as exc:  # requests, HTTP status, JSON: all mean "no answer"
            duration = time.perf_counter() - started
            error = f"prometheus: {type(exc).__name__}: {exc}"[:200]
            for address in pods:
                self.counters.record(self.pool.name, address, False, duration, error)
            return
        duration = time.perf_counter() - started
        folds = fold_answers(profile, answers, self.options.instance_label)
        self._apply(pods, folds, duration)

    async def _query(self, url: str, queries: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
        timeout = self.options.query_timeout_s
        if self._client is None:
            factory = self.options.client_factory or make_client
            self._client = factory(url, timeout)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, _run_queries, self._client, queries,
                                      timeout)
        return await asyncio.wait_for(future, timeout * len(queries) + 1.0)

    def _apply(self, pods: dict[str, Any], folds: dict[str, PodFold], duration: float) -> None:
        now_mono, now_wall = time.monotonic(), time.time()
        pool = self.pool
        for address, pod in pods.items():
            if pool.pods.get(address) is not pod:
                continue  # left while the queries ran
            fold = folds.get(address)
            try:
                if fold is None:
                    raise MetricsParseError("no current series in Prometheus")
                snapshot = fold.builder.build()
            except MetricsParseError as exc:
                pool.mark_scrape(pod.row, False)
                self.counters.record(pool.name, address, False, duration, str(exc)[:200])
                continue
            if not fold.consistent:
                continue  # a scrape landed between our queries: the next poll is whole
            if fold.sampled_at <= self._last_sample.get(address, -math.inf):
                continue  # Prometheus has not scraped the pod since our last poll
            self._last_sample[address] = fold.sampled_at
            age = max(0.0, now_wall - fold.sampled_at) if math.isfinite(fold.sampled_at) else 0.0
            write_snapshot(pool, pod.row, snapshot, self.learner, now_mono - age)
            self.counters.record(pool.name, address, True, duration)
