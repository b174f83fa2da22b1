"""The `GlobalRouterConfig` file: the Tier-2 router across regions (docs/global.md).

Same rules as the `InferenceGatewayConfig` (contract.config): strict, every
default written once on its dataclass field, an unknown field is an error that
names it. A region is a Tier-1 gateway (`igw serve`) reached on its TLS
listener; what it costs, where it is and what it may hold (tags such as
`residency`) come from here, how loaded it is comes from its load summary.

    apiVersion: inference-gateway.io/v1alpha1
    kind: GlobalRouterConfig
    metadata: {name: global}
    spec:
      regions:
        - name: us-east-1
          endpoint: us-east.example.com:443
          caFile: /etc/igw/us-east-ca.pem
          tags: {residency: us}
          costs: {llama-3.1-8b: {perMillionTokens: 0.20}}
      models:
        - {name: llama-3.1-8b, policy: cheapest-within-slo, ttftSlo: 800ms}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract.config import (
    FAILURE_MODES,
    BbrConfig,
    ConfigError,
    CoordinationConfig,
    JwtConfig,
    TenantsConfig,
    TlsConfig,
    _auth,
    _bbr,
    _choice,
    _coordination,
    _endpoint,
    _Fields,
    _number,
    _optional_text,
    _port,
    _tenants,
    _tls,
    _typed,
    check_tenancy,
    check_unique,
    listener_fields,
    model_mapping,
    open_document,
    parse_duration,
    parse_list,
    read_text,
    yaml_document,
)
from contract.endpoints import EndpointError, resolve_endpoint

KIND = "GlobalRouterConfig"
POLICIES = ("cheapest-within-slo", "fastest")
COST_UNITS = {"perGpuHour": "gpu_hour", "perMillionTokens": "million_tokens"}
# The region tag `residency` narrows placement for models whose policy lists residencies.
RESIDENCY_TAG = "residency"
MAX_REGIONS = 64
MAX_MODELS = 1000
# Affinity memory is ~200 bytes per entry: 10M entries bound it at ~2 GB per table.
MAX_AFFINITY_ENTRIES = 10_000_000
_REGION_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_TAG_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")


@dataclass(frozen=True, kw_only=True)
class RegionCost:
    """What one model's traffic costs in a region, in one unit (`COST_UNITS` values).

    Placement compares regions within one unit, so every region pricing a model
    must price it in the same unit (checked at load).
    """

    unit: str
    value: float


@dataclass(frozen=True, kw_only=True)
class RegionConfig:
    """One Tier-1 gateway the global router may send a request to."""

    name: str
    # host:port of the Tier-1 gateway's HTTPS listener (traffic and load summary alike).
    endpoint: str
    # PEM CA bundle that signed the Tier-1 certificate; None: the system trust store.
    ca_file: str | None = None
    # Name checked in the Tier-1 certificate and sent as SNI; None: the endpoint's host.
    server_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    # Requested model name → what its traffic costs here.
    costs: dict[str, RegionCost] = field(default_factory=dict)
    # True: no new request is placed here (in-flight ones finish); the summary is still read.
    drain: bool = False

    @property
    def residency(self) -> str | None:
        return self.tags.get(RESIDENCY_TAG)


@dataclass(frozen=True, kw_only=True)
class ModelPolicy:
    """How one model's requests are placed."""

    # A requested model name (a Tier-1 modelName or LoRA adapter); "" in `defaultPolicy`.
    model: str = ""
    # `cheapest-within-slo`: the cheapest region whose predicted TTFT (its summary's
    # plus the measured RTT) meets the SLO, else the fastest; `fastest`: the fastest.
    policy: str = "cheapest-within-slo"
    ttft_slo_s: float = 1.0
    # Allowed values of the regions' `residency` tag; empty: any region.
    residency: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class PollingConfig:
    """How the global router reads each region's load summary."""

    interval_s: float = 0.25
    timeout_s: float = 1.0
    # A region whose last fresh summary is older than this is unknown: not placed on.
    stale_after_s: float = 2.0


@dataclass(frozen=True, kw_only=True)
class ClientCertificate:
    """The certificate the router presents to every region (mutual TLS between the tiers:
    a region with `spec.tls.clientCaFile` serves its load summary only to it)."""

    certificate_file: str
    key_file: str


@dataclass(frozen=True, kw_only=True)
class AffinityConfig:
    """Keeping conversations where their KV cache is (globalrouter.affinity)."""

    # Block hashes (64 prompt characters each) remembered per region, LRU; 0: no
    # prefix affinity. 200,000 blocks ≈ 12.8M characters ≈ 3M tokens per region, ~40 MB.
    prefix_blocks_per_region: int = 200_000
    # Sessions (`x-session-id`) remembered, LRU; 0: no session affinity.
    max_sessions: int = 100_000
    # A session not seen for this long is forgotten (placed afresh by the policy).
    session_idle_timeout_s: float = 1800.0


@dataclass(frozen=True, kw_only=True)
class GlobalRouterConfig:
    regions: tuple[RegionConfig, ...]
    models: tuple[ModelPolicy, ...] = ()
    default_policy: ModelPolicy = field(default_factory=ModelPolicy)
    name: str = "global"
    namespace: str = "default"
    tls: TlsConfig = field(default_factory=TlsConfig)
    bbr: BbrConfig = field(default_factory=lambda: BbrConfig(enabled=True))
    listen_address: str = "0.0.0.0"
    listen_port: int = 8443
    picker_port: int = 9012
    metrics_port: int = 9092
    envoy_admin_port: int = 9911
    failure_mode: str = "closed"
    polling: PollingConfig = field(default_factory=PollingConfig)
    # A region whose summary says a model's saturation is at least this is passed over
    # for that model while an unsaturated region can take the request (spill-over).
    spill_saturation: float = 1.0
    # Regions Envoy tries after the first (connect failure, reset, 503/429 before headers).
    max_retries: int = 2
    tenants: TenantsConfig | None = None
    coordination: CoordinationConfig | None = None
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    # spec.auth.jwt: every request needs a valid token, checked by the front door's Envoy.
    jwt: JwtConfig | None = None
    # spec.regionClientTls: presented to the regions by the poller and by Envoy.
    region_client_tls: ClientCertificate | None = None

    def policy_for(self, model: str) -> ModelPolicy:
        return next((p for p in self.models if p.model == model), self.default_policy)


def region_address(region: RegionConfig) -> str:
    """The region's `ip:port`, spelt as Envoy's override_host matches it: the router's
    answer and the rendered regions cluster must agree (contract.endpoints). A name with
    several addresses uses the first; an unresolvable one is kept as written."""
    try:
        return resolve_endpoint(region.endpoint)[0]
    except EndpointError:
        return region.endpoint


def _region_name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not _REGION_RE.match(value):
        raise ConfigError(f"{path}: required, a DNS label (lower-case, digits, '-'): {value!r}")
    return value


def _cost(data: Any, path: str) -> RegionCost:
    f = _Fields(data, path)
    given = [(key, f.take(key)) for key in COST_UNITS if f.has(key)]
    f.done()
    if len(given) != 1:
        raise ConfigError(f"{path}: exactly one of {', '.join(COST_UNITS)} is required")
    key, value = given[0]
    return RegionCost(unit=COST_UNITS[key], value=_number(value, f.at(key), 0, 1e9))


def _tags(data: Any, path: str) -> dict[str, str]:
    f = _Fields(data, path)
    tags = {}
    for key in f.remaining():
        value = f.take(key)
        if not isinstance(key, str) or not _TAG_RE.match(key):
            raise ConfigError(f"{path}: tag names are 1-64 letters, digits, '.', '_', '-': {key!r}")
        if not isinstance(value, str) or not _TAG_RE.match(value):
            raise ConfigError(
                f"{path}.{key}: a tag value is 1-64 letters, digits, '.', '_', '-': {value!r}"
            )
        tags[key] = value
    return tags


def _region(data: Any, path: str) -> RegionConfig:
    f = _Fields(data, path)
    name = _region_name(f.take("name"), f.at("name"))
    endpoint = f.take("endpoint")
    if endpoint is None:
        raise ConfigError(f"{f.at('endpoint')}: required, host:port of the Tier-1 listener")
    endpoint = _endpoint(endpoint, f.at("endpoint"))
    ca_file = _optional_text(f, "caFile")
    server_name = _optional_text(f, "serverName")
    tags = _tags(f.take("tags"), f.at("tags"))
    costs = model_mapping(f.take("costs"), f.at("costs"), _cost)
    drain = _typed(f.take("drain", False), bool, f.at("drain"))
    f.done()
    return RegionConfig(
        name=name, endpoint=endpoint, ca_file=ca_file, server_name=server_name, tags=tags,
        costs=costs, drain=drain,
    )


def _regions(data: Any, path: str) -> tuple[RegionConfig, ...]:
    regions = parse_list(data, path, _region, MAX_REGIONS, "regions")
    check_unique(regions, "name", path, "name")
    check_unique(regions, "endpoint", path, "endpoint")
    _check_cost_units(regions, path)
    return regions


def _check_cost_units(regions: tuple[RegionConfig, ...], path: str) -> None:
    """One unit per model across regions: a GPU-hour and a token price do not compare."""
    units: dict[str, tuple[str, int]] = {}
    for i, region in enumerate(regions):
        for model, cost in region.costs.items():
            first = units.setdefault(model, (cost.unit, i))
            if first[0] != cost.unit:
                raise ConfigError(
                    f"{path}[{i}].costs.{model}: priced {_unit_key(cost.unit)} but "
                    f"{path}[{first[1]}] prices it {_unit_key(first[0])}; use one unit per model"
                )


def _unit_key(unit: str) -> str:
    return next(key for key, value in COST_UNITS.items() if value == unit)


def _policy(data: Any, path: str, *, named: bool) -> ModelPolicy:
    f = _Fields(data, path)
    d = ModelPolicy()
    model = ""
    if named:
        model = f.take("name")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{f.at('name')}: required, the requested model name")
    policy = _choice(f.take("policy", d.policy), POLICIES, f.at("policy"))
    slo = parse_duration(f.take("ttftSlo", d.ttft_slo_s), f.at("ttftSlo"))
    raw = f.take("residency", [])
    _typed(raw, list, f.at("residency"))
    residency = tuple(_typed(v, str, f"{f.at('residency')}[{i}]") for i, v in enumerate(raw))
    f.done()
    if slo > 600:
        raise ConfigError(f"{f.at('ttftSlo')}: at most 600s, got {slo:g}s")
    return ModelPolicy(model=model, policy=policy, ttft_slo_s=slo, residency=residency)


def _models(data: Any, path: str) -> tuple[ModelPolicy, ...]:
    if data is None:
        return ()
    _typed(data, list, path)
    if len(data) > MAX_MODELS:
        raise ConfigError(f"{path}: at most {MAX_MODELS} models, got {len(data)}")
    models = tuple(_policy(m, f"{path}[{i}]", named=True) for i, m in enumerate(data))
    check_unique(models, "model", path, "name")
    return models


def _polling(data: Any, path: str) -> PollingConfig:
    f = _Fields(data, path)
    d = PollingConfig()
    interval = parse_duration(f.take("interval", d.interval_s), f.at("interval"))
    timeout = parse_duration(f.take("timeout", d.timeout_s), f.at("timeout"))
    stale = parse_duration(f.take("staleAfter", d.stale_after_s), f.at("staleAfter"))
    f.done()
    if interval < 0.01:
        raise ConfigError(f"{f.at('interval')}: at least 10ms, got {interval:g}s")
    if stale <= interval:
        raise ConfigError(f"{f.at('staleAfter')}: must be longer than interval")
    return PollingConfig(interval_s=interval, timeout_s=timeout, stale_after_s=stale)


def _client_certificate(data: Any, path: str) -> ClientCertificate | None:
    if data is None:
        return None
    f = _Fields(data, path)
    cert = _optional_text(f, "certificateFile")
    key = _optional_text(f, "keyFile")
    f.done()
    if cert is None or key is None:
        raise ConfigError(f"{path}: certificateFile and keyFile are both required")
    return ClientCertificate(certificate_file=cert, key_file=key)


def _affinity(data: Any, path: str) -> AffinityConfig:
    f = _Fields(data, path)
    d = AffinityConfig()
    blocks = _typed(f.take("prefixBlocksPerRegion", d.prefix_blocks_per_region), int,
                    f.at("prefixBlocksPerRegion"))
    sessions = _typed(f.take("maxSessions", d.max_sessions), int, f.at("maxSessions"))
    idle = parse_duration(f.take("sessionIdleTimeout", d.session_idle_timeout_s),
                          f.at("sessionIdleTimeout"))
    f.done()
    if not 0 <= blocks <= MAX_AFFINITY_ENTRIES:
        raise ConfigError(f"{f.at('prefixBlocksPerRegion')}: must be between 0 and "
                          f"{MAX_AFFINITY_ENTRIES}, got {blocks}")
    if not 0 <= sessions <= MAX_AFFINITY_ENTRIES:
        raise ConfigError(f"{f.at('maxSessions')}: must be between 0 and "
                          f"{MAX_AFFINITY_ENTRIES}, got {sessions}")
    return AffinityConfig(prefix_blocks_per_region=blocks, max_sessions=sessions,
                          session_idle_timeout_s=idle)


def _check_residency(
    policies: list[tuple[str, ModelPolicy]], regions: tuple[RegionConfig, ...]
) -> None:
    """A residency no region has would make every request for the model a 503."""
    known = {r.residency for r in regions if r.residency is not None}
    for path, policy in policies:
        for j, value in enumerate(policy.residency):
            if value not in known:
                raise ConfigError(
                    f"{path}.residency[{j}]: no region has the tag "
                    f"residency: {value!r} (regions have: {', '.join(sorted(known)) or 'none'})"
                )


def _ports(f: _Fields, d: GlobalRouterConfig) -> dict[str, int]:
    ports = _Fields(f.take("ports"), f.at("ports"))
    values = {
        "picker_port": _port(ports.take("picker", d.picker_port), ports.at("picker")),
        "metrics_port": _port(ports.take("metrics", d.metrics_port), ports.at("metrics")),
        "envoy_admin_port": _port(
            ports.take("envoyAdmin", d.envoy_admin_port), ports.at("envoyAdmin")
        ),
    }
    ports.done()
    return values


def parse_global_config(doc: Any) -> GlobalRouterConfig:
    """Build a validated global router config from a parsed YAML/JSON document."""
    d = GlobalRouterConfig(regions=())
    name, namespace, spec = open_document(doc, KIND, d.name, d.namespace)
    regions = _regions(spec.take("regions"), "spec.regions")
    models = _models(spec.take("models"), "spec.models")
    default = _policy(spec.take("defaultPolicy"), "spec.defaultPolicy", named=False)
    tls = _tls(spec.take("tls"), "spec.tls")
    bbr = _bbr(spec.take("bbr", {"enabled": True}), "spec.bbr")
    address, port = listener_fields(spec, d.listen_address, d.listen_port)
    ports = _ports(spec, d)
    failure = _choice(spec.take("failureMode", d.failure_mode), FAILURE_MODES, "spec.failureMode")
    polling = _polling(spec.take("polling"), "spec.polling")
    spill = _number(
        spec.take("spillSaturation", d.spill_saturation), "spec.spillSaturation", 0.1, 100
    )
    retries = _typed(spec.take("maxRetries", d.max_retries), int, "spec.maxRetries")
    tenants = _tenants(spec.take("tenants"), "spec.tenants")
    coordination = _coordination(spec.take("coordination"), "spec.coordination")
    affinity = _affinity(spec.take("affinity"), "spec.affinity")
    jwt = _auth(spec.take("auth"), "spec.auth")
    client_tls = _client_certificate(spec.take("regionClientTls"), "spec.regionClientTls")
    spec.done()
    if not 0 <= retries <= 8:
        raise ConfigError(f"spec.maxRetries: must be between 0 and 8, got {retries}")
    all_ports = [port, *ports.values()]
    if len(set(all_ports)) != len(all_ports):
        raise ConfigError(f"spec: listener.port and ports.* must all differ: {all_ports}")
    policies = [(f"spec.models[{i}]", m) for i, m in enumerate(models)]
    _check_residency([*policies, ("spec.defaultPolicy", default)], regions)
    if tenants is not None:
        check_tenancy(tenants, jwt, {m.model for m in models}, "not a model of spec.models")
    return GlobalRouterConfig(
        regions=regions, models=models, default_policy=default, name=name, namespace=namespace,
        tls=tls, bbr=bbr, listen_address=address, listen_port=port, failure_mode=failure,
        polling=polling, spill_saturation=spill, max_retries=retries, tenants=tenants,
        coordination=coordination, affinity=affinity, jwt=jwt,
        region_client_tls=client_tls, **ports,
    )


def load_global_config(path: str | Path) -> GlobalRouterConfig:
    """Read and validate a global router config file; every problem is one ConfigError line."""
    return parse_global_config(yaml_document(read_text(path)))
