"""From a request body to a routing decision: bbr → pool → admission → pick.

The director is the one place that knows the order of a request's steps. It
holds no transport code (that is the handler) and no scoring (that is the
scheduler): it parses the body once, finds the pool in O(1), asks the pool's
scheduler for a pod plus fallbacks, and closes the books when the request ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from bbr.model_map import ModelMap
from bbr.prefix import prefix_hashes
from bbr.request import parse_request
from contract import headers as hdr
from contract.config import GatewayConfig
from contract.errors import ApiError, InvalidRequest, NoReadyEndpoint, Overloaded
from picker.datastore import Datastore, Pool
from picker.gateway_metrics import GatewayMetrics
from picker.scheduling.admission import AdmissionQueue
from picker.scheduling.flow import committed
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import pool_saturated
from picker.scheduling.scheduler import NoCandidates, Scheduler
from picker.tenants.identity import Tenant, TenantDirectory

if TYPE_CHECKING:
    from picker.coordination.outbox import Outbox
    from picker.tenants.limits import Grant, Limiter
    from picker.tenants.usage import UsageLedger

log = logging.getLogger("picker.director")

MAX_PREFIX_BLOCKS = 2048
_CRITICALITY_PRIORITY = {"critical": 10, "standard": 0, "sheddable": -10}


@dataclass(slots=True)
class RequestInfo:
    """What the handler read from the request headers."""

    path: str = ""
    content_type: str | None = None
    content_encoding: str | None = None
    priority: str | None = None
    criticality: str | None = None
    request_id: str = ""
    authorization: str | None = None
    tenant_claim: str | None = None
    # The client's allow-list of regions (the global router reads it; Tier 1 ignores it).
    regions: str | None = None
    # The client's session id (the global router keeps a session in one region).
    session: str | None = None


@dataclass(slots=True)
class Decision:
    """One routed request, from pick to end."""

    pool: Pool
    scheduler: Scheduler
    request: SchedulingRequest
    base_model: str
    started: float
    row: int = -1
    address: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    admission_wait: float | None = None
    status: int = 0
    # Its id among this replica's requests shared with the others (0: not shared).
    shared_id: int = 0
    # Who sent it (None: tenants off) and what the limiter granted it until it ends.
    tenant: Tenant | None = None
    grant: Grant | None = None
    # The tenant's x-ratelimit-* figures after this request (answered as metadata).
    limit_headers: list[tuple[str, str]] | None = None
    # Envoy's x-request-id: what the access log names it by (picker.tenants.usage).
    request_id: str = ""

    @property
    def dispatched(self) -> bool:
        return self.row >= 0


def _priority(info: RequestInfo) -> tuple[int, bool]:
    """Request priority and sheddability from the client's hint headers."""
    priority = 0
    if info.priority:
        try:
            priority = max(-100, min(100, int(info.priority)))
        except ValueError:
            raise _bad_header(hdr.PRIORITY, info.priority) from None
    criticality = (info.criticality or "").lower()
    if criticality and criticality not in _CRITICALITY_PRIORITY:
        raise _bad_header(hdr.CRITICALITY, info.criticality or "")
    if criticality and not info.priority:
        priority = _CRITICALITY_PRIORITY[criticality]
    return priority, criticality == "sheddable" or priority < 0


def _bad_header(name: str, value: str) -> ApiError:
    return InvalidRequest(f"header {name}: invalid value {value[:64]!r}")


class Director:
    """Routes requests for every pool of the current config."""

    def __init__(
        self,
        datastore: Datastore,
        metrics: GatewayMetrics,
        rng: np.random.Generator | None = None,
        limiter: Limiter | None = None,
        ledger: UsageLedger | None = None,
    ) -> None:
        self.datastore = datastore
        self.metrics = metrics
        # spec.tenants: who sends a request, and (the limiter) what each may send.
        self.tenants = TenantDirectory()
        self.limiter = limiter
        # Tenant requests until Envoy's access log reports their output tokens.
        self.ledger = ledger
        self.rng = rng or np.random.default_rng()
        self.schedulers: dict[str, Scheduler] = {}
        self.admission: dict[str, AdmissionQueue] = {}
        # Where dispatches and completions are recorded for the other gateway replicas
        # (picker.coordination sets it; None: not coordinated). Appending never waits.
        self.outbox: Outbox | None = None
        self.apply_config(datastore.config)

    def apply_config(self, config: GatewayConfig) -> None:
        """Adopt a (re)loaded config; schedulers keep their learned state."""
        self.config = config
        self.model_map = ModelMap.from_pools(
            (s.name, s.model_name, s.lora_adapters) for s in config.schedulers
        )
        self._models_body = self.model_map.models_response()
        schedulers: dict[str, Scheduler] = {}
        admission: dict[str, AdmissionQueue] = {}
        for name, pool in self.datastore.pools.items():
            sched = self.schedulers.get(name)
            if sched is None:
                sched = Scheduler(pool, max_fallbacks=config.max_fallbacks, rng=self.rng)
            else:
                sched.reconfigure(pool, config.max_fallbacks)
            schedulers[name] = sched
            admission[name] = self.admission.get(name) or AdmissionQueue(pool, sched)
        for name, queue in self.admission.items():
            if name not in admission:
                queue.close()
        self.schedulers = schedulers
        self.admission = admission
        self.tenants.configure(config.tenants)
        if self.limiter is not None and config.tenants is not None:
            self.limiter.configure(config.tenants.limits())

    def models_body(self) -> bytes:
        return self._models_body

    def route_now(self, body: bytes, info: RequestInfo) -> Decision:
        """Parse, resolve and pick; when the pool is saturated, return a decision
        that must wait in admission (`admission_wait` set) before it is picked."""
        started = time.monotonic()
        decision = self._decision(body, info, started, count_errors=True)
        if decision.tenant is not None:
            self._limit(decision, started)
        try:
            pool = decision.pool
            try:
                wait = self.admission[pool.name].must_wait(decision.request, started)
            except Overloaded:
                self.metrics.shed(pool.name)
                raise
            if wait:
                decision.admission_wait = pool.config.saturation.queue_timeout_s
                return decision
            self._pick(decision, started)
        except ApiError:
            self._release(decision)
            raise
        return decision

    def _limit(self, decision: Decision, now: float) -> None:
        """The tenant's limits, before any queueing: over a limit is a 429 at once.

        What is reserved is the prompt plus `max_tokens`, the most the request can
        cost; the ledger corrects it with the real output once the response ended.
        """
        tenant = decision.tenant
        request = decision.request
        tokens = request.prompt_tokens + request.max_tokens
        if self.limiter is not None:
            try:
                decision.grant = self.limiter.admit(tenant.name, request.model, tokens, now)
            except ApiError as exc:
                if exc.status == 429:
                    tenant.usage.rate_limited += 1
                self.metrics.rejected(exc.status)
                raise
        usage = tenant.usage
        usage.requests += 1
        usage.prompt_tokens += request.prompt_tokens
        usage.reserved_tokens += tokens

    def abandon(self, decision: Decision) -> None:
        """A held request's client went away: before it was admitted, or after its
        release dispatched it but before Envoy got the route (it ends there, failed:
        its short life teaches nothing about the pod's speed)."""
        if decision.dispatched:
            self.complete(decision, ok=False)
        else:
            self._release(decision)

    def _release(self, decision: Decision) -> None:
        """The request is over (ended, refused or abandoned): its concurrency slot back."""
        grant = decision.grant
        if grant is not None and self.limiter is not None:
            decision.grant = None
            self.limiter.release(grant)

    def _decision(
        self, body: bytes, info: RequestInfo, started: float, count_errors: bool
    ) -> Decision:
        """Identify the tenant, parse the body once and resolve its pool: everything
        before the pick (`explain`, not counting, identifies nobody)."""
        try:
            tenant = (
                self.tenants.identify(info.authorization, info.tenant_claim)
                if count_errors else None
            )
            parsed = parse_request(
                body,
                info.path,
                info.content_type,
                info.content_encoding,
                self.config.bbr.max_request_body_bytes,
            )
            route = self.model_map.resolve(parsed.model)
            priority, sheddable = _priority(info)
        except ApiError as exc:
            if count_errors:
                self.metrics.rejected(exc.status)
            raise
        pool = self.datastore.pools[route.pool]
        request = SchedulingRequest(
            model=parsed.model,
            adapter=route.adapter,
            prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens,
            # Seeded by the requested name: engines key their prefix cache per adapter.
            prefix_hashes=prefix_hashes(parsed.model, parsed.prompt, MAX_PREFIX_BLOCKS),
            priority=priority,
            sheddable=sheddable,
        )
        if tenant is not None:
            request.tenant = tenant.name
            request.tenant_weight = tenant.weight
        return Decision(
            pool=pool,
            scheduler=self.schedulers[pool.name],
            request=request,
            base_model=route.base_model,
            started=started,
            tenant=tenant,
            request_id=info.request_id,
        )

    def saturated(self, pool: Pool, now: float) -> bool:
        """Saturated, full (flow control), or others already wait (the admin API's view)."""
        queue = self.admission.get(pool.name)
        if (queue is not None and len(queue) > 0) or pool_saturated(pool, now):
            return True
        sched = self.schedulers.get(pool.name)
        return sched is not None and committed(sched.state, now).saturation >= 1.0

    def explain(self, body: bytes, info: RequestInfo) -> dict:
        """What routing this body would do now; nothing dispatched, nothing counted."""
        decision = self._decision(body, info, time.monotonic(), count_errors=False)
        return decision.scheduler.explain(decision.request, time.monotonic())

    async def admit(self, decision: Decision) -> None:
        """Wait for capacity (bounded queue, highest priority first), then pick: inside
        the queue's release, so one release grants every waiter that fits at once."""
        queue = self.admission[decision.pool.name]
        picked = False

        def pick() -> None:
            nonlocal picked
            picked = True  # its own errors are counted by _pick
            self._pick(decision, time.monotonic())

        try:
            try:
                dispatched = await queue.acquire(
                    decision.request, decision.admission_wait or 0.0, on_grant=pick)
            except ApiError as exc:
                if not picked:
                    self.metrics.rejected(exc.status)
                raise
            if not dispatched:
                self._pick(decision, time.monotonic())
        except BaseException:  # refused, timed out, or cancelled (the client went away)
            if not decision.dispatched:
                self._release(decision)
            raise

    def _pick(self, decision: Decision, now: float) -> None:
        pool = decision.pool
        try:
            pick = decision.scheduler.pick(decision.request, now)
        except NoCandidates as exc:
            self.metrics.rejected(503)
            raise NoReadyEndpoint(
                f"no ready endpoint for model {decision.request.model!r} (pool {pool.name})",
                retry_after=1,
            ) from exc
        decision.row = int(pick.rows[0])
        decision.address = pick.addresses[0]
        decision.scheduler.on_dispatch(decision.row, decision.request, now, pick.cached)
        if self.outbox is not None:
            decision.shared_id = self.outbox.dispatched(
                pool.name, decision.address, decision.request, pick.cached
            )
        decision.headers = [
            (hdr.POOL, pool.name),
            (hdr.DESTINATION_ENDPOINT, ",".join(pick.addresses)),
            (hdr.MODEL_NAME, decision.request.model),
            (hdr.BASE_MODEL_NAME, decision.base_model),
        ]
        if decision.grant is not None and self.limiter is not None:
            decision.limit_headers = self.limiter.headers(decision.grant)
        if decision.tenant is not None and self.ledger is not None:
            self.ledger.opened(decision.request_id, decision.tenant, decision.grant,
                               decision.request.prompt_tokens)
        self.metrics.picked(pool.name, pick.addresses[0], time.monotonic() - decision.started)
        log.debug(
            "pick pool=%s model=%s pod=%s fallbacks=%s",
            pool.name,
            decision.request.model,
            pick.addresses[0],
            pick.addresses[1:],
        )

    def complete(self, decision: Decision, ok: bool | None = None) -> None:
        """The HTTP request ended (stream closed): release its accounting. `ok` None:
        judged from the response status, when one was seen."""
        self._release(decision)
        if not decision.dispatched:
            return
        if decision.tenant is not None and self.ledger is not None:
            self.ledger.ended(decision.request_id)
        now = time.monotonic()
        if ok is None:
            ok = decision.status == 0 or decision.status < 500
        pool = decision.pool
        decision.scheduler.on_complete(
            decision.row,
            decision.request,
            now,
            now - decision.started,
            ok,
            address=decision.address,
        )
        if decision.shared_id and self.outbox is not None:
            self.outbox.completed(decision.shared_id, now - decision.started if ok else None)
        self.metrics.completed(pool.name, decision.status)
        queue = self.admission.get(pool.name)
        if queue is not None:
            queue.notify()
