"""Pool membership and live config from the Kubernetes API: list + watch, nothing more.

One watch per distinct `modelSelector.matchLabels` (pools sharing a selector
share the watch), plus one on the `InferenceGatewayConfig` named by
`IGW_CONFIG_RESOURCE`. Each watch is a *session*: list (a consistent
snapshot and its resourceVersion), then watch from that resourceVersion.

The wire protocol is lightkube's: it builds the requests, decodes the
newline-delimited events, keeps the last resourceVersion (BOOKMARKs included)
and, when a stream breaks, re-opens it from that resourceVersion with the
delay our `on_error` answers. Our code only decides what an error means:

- `410 Gone` (an ERROR event or the HTTP status): the resourceVersion was
  compacted away, events were lost, so the session ends and a fresh list
  replaces the cache (a plain re-watch would never report pods deleted in
  the gap);
- a broken stream: resumed from the last resourceVersion, a few times with
  growing delays, then a fresh list after a bounded backoff;
- no session lives longer than the resync period (jittered): a half-open TCP
  connection (no read timeout on a watch) costs at most that long, and the
  periodic list corrects any drift.

While the API server is unreachable, pools keep their last known members:
serving from a slightly stale list beats emptying every pool.

lightkube's asyncio client runs on the picker's event loop: watches are
sockets waiting, not threads, and decoding a Pod event (msgspec) is a few
microseconds; a list is paged (`limit`) so a large namespace never holds the
loop for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx2
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import OnErrorAction, OnErrorResult, PatchType

from contract.config import GatewayConfig
from picker.cancellation import cancel_and_wait
from picker.datastore import Datastore
from picker.discovery.config_resource import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Outcome,
    evaluate,
    status_patch,
    user_document,
)
from picker.discovery.pods import PodView, SelectorKey, members, pod_view, selector_key
from picker.discovery.settings import DiscoverySettings

log = logging.getLogger("picker.discovery")

InferenceGatewayConfigResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)

LIST_CHUNK = 500
MAX_PODS_PER_SELECTOR = 10_000
MAX_RESUMES = 5
MIN_HEALTHY_SESSION_S = 1.0
CONFIG_POLL_S = 0.5
REQUEST_TIMEOUT_S = 10.0
# Watches end within this on stop (cancelled until done: see picker.cancellation).
STOP_TIMEOUT_S = 5.0


class DiscoveryTarget(Protocol):
    """What discovery needs from the picker (`PickerApp` satisfies it)."""

    config: GatewayConfig
    datastore: Datastore

    def apply_config(self, config: GatewayConfig) -> bool: ...

    def membership_changed(self, pool_name: str) -> None: ...


@dataclass
class _PodWatch:
    """One selector's pods as last seen, and the task keeping them current."""

    key: SelectorKey
    pods: dict[str, PodView] = field(default_factory=dict)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.key)


class _StreamErrors:
    """lightkube's `on_error`: resume broken streams, end the session on 410 or too many."""

    def __init__(self, what: str, backoff: Callable[[int], float]) -> None:
        self.what = what
        self.backoff = backoff
        self.gone = False
        self.failed: Exception | None = None

    def __call__(self, exc: Exception, count: int) -> OnErrorResult:
        if is_gone(exc):
            self.gone = True
            return OnErrorResult(OnErrorAction.STOP)
        if count > MAX_RESUMES:
            self.failed = exc
            return OnErrorResult(OnErrorAction.STOP)
        delay = self.backoff(count)
        log.warning(
            "watch %s: %s; resuming from the last resourceVersion in %.1fs",
            self.what,
            describe(exc),
            delay,
        )
        return OnErrorResult(OnErrorAction.RETRY, sleep=delay)


def is_gone(exc: BaseException) -> bool:
    """410: the resourceVersion we asked for is older than the server keeps."""
    if isinstance(exc, ApiError):
        return exc.status is not None and exc.status.code == 410
    if isinstance(exc, httpx2.HTTPStatusError):
        return exc.response.status_code == 410
    return False


def describe(exc: BaseException) -> str:
    """One line for the log; a 403 says what to check."""
    if isinstance(exc, ApiError) and exc.status is not None:
        hint = " (check the gateway's Role: get/list/watch)" if exc.status.code == 403 else ""
        return f"API error {exc.status.code} {exc.status.reason}: {exc.status.message}{hint}"
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"HTTP {exc.response.status_code} from {exc.request.url.path}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class KubernetesDiscovery:
    """Feeds `Pool.set_members` from pod watches and `apply_config` from the config resource."""

    def __init__(
        self,
        target: DiscoveryTarget,
        settings: DiscoverySettings,
        client: AsyncClient | None = None,
        *,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self._target = target
        self._settings = settings
        self._client = client
        self._owns_client = client is None
        self._backoff_base = backoff_base_s
        self._backoff_max = backoff_max_s
        self._pod_watches: dict[SelectorKey, _PodWatch] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._seen_config: GatewayConfig | None = None
        self._config_synced = asyncio.Event()
        self._last_document: dict[str, Any] | None = None
        self._last_status: tuple[int | None, Outcome] | None = None
        self.pod_namespace = settings.pod_namespace or "default"
        self.config_namespace = "default"

    # -- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Connect, follow the config resource, start pod watches; wait (bounded) to sync."""
        if self._client is None:
            kubeconfig = await asyncio.to_thread(KubeConfig.from_env)
            self._client = AsyncClient(
                config=kubeconfig, timeout=httpx2.Timeout(REQUEST_TIMEOUT_S), http2=True
            )
        self.pod_namespace = self._settings.pod_namespace or self._client.namespace
        deadline = time.monotonic() + self._settings.initial_sync_timeout_s
        resource = self._settings.config_resource
        if resource is not None:
            # read the resource first: it may name other schedulers than the file
            self.config_namespace = resource.namespace or self._client.namespace
            self._tasks.append(asyncio.create_task(self._run_config(), name="igw-config-watch"))
            try:
                async with asyncio.timeout(self._settings.initial_sync_timeout_s):
                    await self._config_synced.wait()
            except TimeoutError:
                log.warning("kubernetes discovery: config resource not read yet; using the file")
        else:
            self._config_synced.set()
        self.reconcile()
        self._tasks.append(asyncio.create_task(self._follow_config(), name="igw-config-follow"))
        await self.wait_synced(max(0.0, deadline - time.monotonic()))
        log.info(
            "kubernetes discovery: namespace=%s selectors=%s config_resource=%s",
            self.pod_namespace,
            ";".join(w.selector for w in self._pod_watches.values()) or "-",
            f"{self.config_namespace}/{resource.name}" if resource else "-",
        )

    async def stop(self) -> None:
        """End every watch and close the client; pools keep their members (we are stopping)."""
        tasks = self._tasks + [w.task for w in self._pod_watches.values() if w.task is not None]
        await cancel_and_wait(tasks, STOP_TIMEOUT_S)
        self._tasks.clear()
        self._pod_watches.clear()
        if self._owns_client and self._client is not None:
            await self._client.close()

    async def wait_synced(self, timeout: float) -> bool:
        """True once every watch has listed at least once; False (logged) after `timeout`."""
        events = [self._config_synced, *(w.synced for w in self._pod_watches.values())]
        try:
            async with asyncio.timeout(timeout):
                for event in events:
                    await event.wait()
        except TimeoutError:
            log.warning(
                "kubernetes discovery: not synced after %.0fs; serving what is known, "
                "watches keep retrying",
                timeout,
            )
            return False
        return True

    def backoff(self, attempt: int) -> float:
        """Exponential, capped, jittered: many gateways never retry in lockstep."""
        delay = min(self._backoff_max, self._backoff_base * 2 ** max(0, attempt - 1))
        return delay * random.uniform(0.8, 1.2)

    def _resync_deadline(self) -> float:
        return self._settings.resync_s * random.uniform(0.9, 1.1)

    # -- pools -----------------------------------------------------------

    def reconcile(self) -> None:
        """One watch per distinct selector of the running config; feed pools from what is known."""
        config = self._target.config
        self._seen_config = config
        wanted = {
            selector_key(s.match_labels)
            for s in config.schedulers
            if s.match_labels and not s.endpoints
        }
        for key in [k for k in self._pod_watches if k not in wanted]:
            watch = self._pod_watches.pop(key)
            if watch.task is not None:
                watch.task.cancel()
            log.info("pods %s: no pool uses this selector any more; watch stopped", watch.selector)
        for key in wanted:
            watch = self._pod_watches.get(key)
            if watch is None:
                watch = self._pod_watches[key] = _PodWatch(key)
                watch.task = asyncio.create_task(
                    self._run_pods(watch), name=f"igw-pods-{watch.selector}"
                )
            else:
                self._feed(watch)

    async def _follow_config(self) -> None:
        """Notice configs applied from elsewhere (the file reload) and re-target the watches."""
        while True:
            await asyncio.sleep(CONFIG_POLL_S)
            if self._target.config is not self._seen_config:
                self.reconcile()

    def _feed(self, watch: _PodWatch) -> None:
        """Push the selector's serving pods into every pool that uses it (and tell Envoy)."""
        if not watch.synced.is_set():
            return
        for pool in list(self._target.datastore.pools.values()):
            cfg = pool.config
            if cfg.endpoints or not cfg.match_labels or selector_key(cfg.match_labels) != watch.key:
                continue
            addresses = members(watch.pods.values(), cfg.target_port)
            if pool.set_members(addresses):
                log.info("pool %s: %d members (%s)", pool.name, len(addresses), watch.selector)
                self._target.membership_changed(pool.name)

    async def _run_pods(self, watch: _PodWatch) -> None:
        await self._sessions(lambda: self._pod_session(watch), f"pods {watch.selector}")

    async def _pod_session(self, watch: _PodWatch) -> None:
        assert self._client is not None
        labels = dict(watch.key)
        listing = self._client.list(
            Pod, namespace=self.pod_namespace, labels=labels, chunk_size=LIST_CHUNK
        )
        pods: dict[str, PodView] = {}
        async for pod in listing:
            view = pod_view(pod)
            if len(pods) < MAX_PODS_PER_SELECTOR:
                pods[view.name] = view
        if len(pods) >= MAX_PODS_PER_SELECTOR:
            log.warning("pods %s: more than %d pods, the rest ignored", watch.selector, len(pods))
        watch.pods = pods
        watch.synced.set()
        self._feed(watch)
        errors = _StreamErrors(f"pods {watch.selector}", self.backoff)
        stream = self._client.watch(
            Pod,
            namespace=self.pod_namespace,
            labels=labels,
            resource_version=listing.resourceVersion,
            server_timeout=max(1, int(self._settings.resync_s)),
            on_error=errors,
        )
        await self._consume(stream, errors, lambda etype, pod: self._pod_event(watch, etype, pod))

    async def _pod_event(self, watch: _PodWatch, etype: str, pod: Any) -> None:
        if etype == "DELETED":
            watch.pods.pop(pod.metadata.name, None)
        elif etype in ("ADDED", "MODIFIED"):
            view = pod_view(pod)
            if view.name in watch.pods or len(watch.pods) < MAX_PODS_PER_SELECTOR:
                watch.pods[view.name] = view
        else:  # BOOKMARK: lightkube already took its resourceVersion
            return
        self._feed(watch)

    # -- sessions --------------------------------------------------------

    async def _sessions(self, session: Callable[[], Any], what: str) -> None:
        """Run list+watch sessions forever: relist at once after 410/resync, back off on errors."""
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                delay = self.backoff(failures)
                log.warning("%s: %s; relisting in %.1fs", what, describe(exc), delay)
                await asyncio.sleep(delay)
                continue
            if time.monotonic() - started < MIN_HEALTHY_SESSION_S:
                failures += 1  # a session that ends at once, over and over, must not spin
                await asyncio.sleep(self.backoff(failures))
            else:
                failures = 0

    async def _consume(
        self,
        stream: Any,
        errors: _StreamErrors,
        handle: Callable[[str, Any], Awaitable[None]],
    ) -> None:
        """Deliver events until resync time, a 410 (relist) or a stream beyond repair."""
        try:
            async with asyncio.timeout(self._resync_deadline()), contextlib.aclosing(stream):
                async for etype, obj in stream:
                    await handle(etype, obj)
        except TimeoutError:
            log.debug("watch %s: resync", errors.what)
            return
        if errors.failed is not None:
            raise errors.failed
        if errors.gone:
            log.info("watch %s: 410 Gone (resourceVersion expired); relisting", errors.what)

    # -- the config resource --------------------------------------------

    async def _run_config(self) -> None:
        resource = self._settings.config_resource
        assert resource is not None
        what = f"config {self.config_namespace}/{resource.name}"
        await self._sessions(self._config_session, what)

    async def _config_session(self) -> None:
        assert self._client is not None and self._settings.config_resource is not None
        name = self._settings.config_resource.name
        fields = {"metadata.name": name}
        listing = self._client.list(
            InferenceGatewayConfigResource, namespace=self.config_namespace, fields=fields
        )
        items = [obj async for obj in listing]
        if items:
            await self._config_object(items[0].to_dict())
        elif not self._config_synced.is_set():
            log.warning(
                "config resource %s/%s not found; running the file config until it appears",
                self.config_namespace,
                name,
            )
        self._config_synced.set()
        errors = _StreamErrors(f"config {self.config_namespace}/{name}", self.backoff)
        stream = self._client.watch(
            InferenceGatewayConfigResource,
            namespace=self.config_namespace,
            fields=fields,
            resource_version=listing.resourceVersion,
            server_timeout=max(1, int(self._settings.resync_s)),
            on_error=errors,
        )
        await self._consume(stream, errors, self._config_event)

    async def _config_event(self, etype: str, resource: Any) -> None:
        obj = resource.to_dict()
        if etype == "DELETED":
            self._last_document = None
            log.warning(
                "config resource %s/%s deleted; keeping the running config",
                self.config_namespace,
                (obj.get("metadata") or {}).get("name"),
            )
        elif etype in ("ADDED", "MODIFIED"):
            await self._config_object(obj)

    async def _config_object(self, obj: dict[str, Any]) -> None:
        """Apply a new spec if valid; an unchanged spec (a status write, a relist) is a no-op."""
        document = user_document(obj)
        if document == self._last_document:
            return
        self._last_document = document
        meta = obj.get("metadata") or {}
        where = f"{meta.get('namespace')}/{meta.get('name')}"
        _, outcome = evaluate(obj, self._target.apply_config)
        if outcome.accepted:
            log.info("config resource %s: %s", where, outcome.message)
            self.reconcile()
        else:
            log.error(
                "config resource %s refused (%s), keeping the running config: %s",
                where,
                outcome.reason,
                outcome.message,
            )
        await self._write_status(meta, outcome, len(self._target.config.schedulers))

    async def _write_status(self, meta: dict[str, Any], outcome: Outcome, pools: int) -> None:
        """Tell `kubectl get` users whether their change took; best effort, never fatal."""
        generation = meta.get("generation")
        if not self._settings.write_status or self._last_status == (generation, outcome):
            return
        assert self._client is not None
        try:
            await self._client.patch(
                InferenceGatewayConfigResource.Status,
                meta["name"],
                status_patch(outcome, generation, pools),
                namespace=meta.get("namespace") or self.config_namespace,
                patch_type=PatchType.MERGE,
            )
            self._last_status = (generation, outcome)
        except (httpx2.HTTPError, KeyError) as exc:
            log.warning("config resource status not written: %s", describe(exc))
