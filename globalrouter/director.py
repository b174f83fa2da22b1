"""From a request body to a region: bbr → model → tenant limits → placement → answer.

The global counterpart of picker.director, driven by the same ext_proc stream
state machine (picker.handlers, whose `Router` protocol this satisfies). The
answer is `envoy.lb` dynamic metadata: the regions to try, best first, as
`x-gateway-destination-endpoint: ip:port,ip:port` for the regions cluster's
override_host policy (the n-th attempt goes to the n-th region), and the first
region's name. Which region actually answered is added to the response by
Envoy from the endpoint's metadata (igw_envoy.global_front), so a retried
request names the region that served it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import orjson

from bbr.prefix import prefix_hashes
from bbr.request import parse_request
from contract import headers as hdr
from contract.errors import ApiError, ModelNotFound, NoEligibleRegion
from contract.global_config import GlobalRouterConfig
from globalrouter.affinity import RegionAffinity
from globalrouter.placement import allow_list, place
from globalrouter.regions import RegionTable
from globalrouter.session_sync import SessionSync
from picker.director import RequestInfo
from picker.tenants.identity import Tenant, TenantDirectory
from picker.tenants.limits import Grant, Limiter

log = logging.getLogger("globalrouter.director")

# Prefix blocks hashed per request (64 characters each): as Tier 1 (picker.director).
MAX_PREFIX_BLOCKS = 2048
# Prompts shorter than this (characters, ~256 tokens) have no prefix affinity here: their
# prefill is a few milliseconds anywhere, not worth a region, and hashing them is not free.
MIN_AFFINITY_CHARS = 1024


@dataclass(slots=True)
class GlobalDecision:
    """One placed request, from placement to its end (picker.handlers.Routed)."""

    model: str
    started: float
    region: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    limit_headers: list[tuple[str, str]] | None = None
    admission_wait: float | None = None  # the global router never holds a request
    status: int = 0
    tenant: Tenant | None = None
    grant: Grant | None = None


class GlobalDirector:
    """Places the requests of every model on the regions of one config."""

    def __init__(self, config: GlobalRouterConfig, table: RegionTable,
                 limiter: Limiter | None = None) -> None:
        self.config = config
        self.table = table
        self.tenants = TenantDirectory(config.tenants)
        self.limiter = limiter
        if limiter is not None and config.tenants is not None:
            limiter.configure(config.tenants.limits())
        self.count = 1 + config.max_retries
        self.affinity = RegionAffinity(config.affinity, len(table))
        # Set by the app with spec.coordination: bindings shared with the other replicas.
        self.session_sync: SessionSync | None = None
        self.affine: Counter[str] = Counter()  # what affinity did → requests
        self.placed: Counter[str] = Counter()  # first-choice region → requests
        self.refused: Counter[int] = Counter()  # status → requests answered here

    def reconfigure(self, config: GlobalRouterConfig) -> None:
        """A reloaded config (globalrouter.reload): policies, tenants and limits from it."""
        self.config = config
        self.tenants.configure(config.tenants)
        if self.limiter is not None and config.tenants is not None:
            self.limiter.configure(config.tenants.limits())

    def models_body(self) -> bytes:
        """`GET /v1/models`: every name some region's summary serves (OpenAI's list)."""
        cards = [{"id": name, "object": "model", "owned_by": "inference-gateway"}
                 for name in self.table.models()]
        return orjson.dumps({"object": "list", "data": cards})

    def route_now(self, body: bytes, info: RequestInfo) -> GlobalDecision:
        started = time.monotonic()
        try:
            decision = self._place(body, info, started)
        except ApiError as exc:
            self.refused[exc.status] += 1
            raise
        return decision

    def _place(self, body: bytes, info: RequestInfo, now: float) -> GlobalDecision:
        tenant = self.tenants.identify(info.authorization, info.tenant_claim)
        parsed = parse_request(body, info.path, info.content_type, info.content_encoding,
                               self.config.bbr.max_request_body_bytes)
        model = parsed.model
        view = self.table.views.get(model)
        if view is None:
            if not self.table.fresh(now).any():
                raise NoEligibleRegion("no region has a fresh load summary; retry shortly")
            raise ModelNotFound(model)
        decision = GlobalDecision(model=model, started=now, tenant=tenant)
        session_row = self.affinity.session_row(info.session, now)
        hashes = (prefix_hashes(model, parsed.prompt, MAX_PREFIX_BLOCKS).tolist()
                  if len(parsed.prompt) >= MIN_AFFINITY_CHARS else [])
        placement = place(self.table, model, view, self.config.policy_for(model),
                          allow_list(self.table, info.regions), now, self.count, info.regions,
                          prompt_tokens=parsed.prompt_tokens, session_row=session_row,
                          cached=self.affinity.matched(hashes, len(parsed.prompt)))
        if tenant is not None and self.limiter is not None:
            tokens = parsed.prompt_tokens + parsed.max_tokens
            decision.grant = self.limiter.admit(tenant.name, model, tokens, now)
            decision.limit_headers = self.limiter.headers(decision.grant)
        self.table.note_placed(model, placement.rows[0], parsed.prompt_tokens)
        decision.region = placement.names[0]
        if self.affinity.record(info.session, hashes, placement.rows[0], now) and (
                self.session_sync is not None):
            self.session_sync.record(info.session, placement.rows[0])
        if placement.affinity:
            self.affine[placement.affinity] += 1
        decision.headers = [
            (hdr.DESTINATION_ENDPOINT, ",".join(placement.addresses)),
            (hdr.REGION, decision.region),
        ]
        self.placed[decision.region] += 1
        log.debug("place model=%s regions=%s predicted_ttft=%.3f meets_slo=%s affinity=%s",
                  model, ",".join(placement.names), placement.predicted_ttft_s,
                  placement.meets_slo, placement.affinity or "-")
        return decision

    async def admit(self, decision: GlobalDecision) -> None:
        """Never reached: `admission_wait` is always None (Tier 1 queues, not Tier 2)."""

    def abandon(self, decision: GlobalDecision) -> None:
        self._release(decision)

    def complete(self, decision: GlobalDecision) -> None:
        """The HTTP request ended: its concurrency slot back."""
        self._release(decision)

    def _release(self, decision: GlobalDecision) -> None:
        grant = decision.grant
        if grant is not None and self.limiter is not None:
            decision.grant = None
            self.limiter.release(grant)
