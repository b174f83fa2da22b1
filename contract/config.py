"""The `InferenceGatewayConfig` file: loading, defaults and strict validation.

The HyperPod format is accepted verbatim, so a user of that gateway can bring
the same file; our additions (static endpoints, metrics source, listener,
failure mode, admission) live beside its fields. Every default is written
once, on its dataclass field; the parser reads it from a default instance, and
every model is keyword-only so a reordered field cannot shift a value.
Validation is strict: an unknown field is an error naming the field, because
a misspelt weight silently ignored would change routing unnoticed.
"""

from __future__ import annotations

import ipaddress
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from contract.endpoints import EndpointError, check_endpoint

API_VERSIONS = (
    "inference.sagemaker.aws.amazon.com/v1alpha1",
    "inference-gateway.io/v1alpha1",
)
KIND = "InferenceGatewayConfig"

MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_SCHEDULERS = 100
SCHEDULER_PROFILES = ("llm-d", "epp", "least-request", "round-robin", "random")
ENGINE_TYPES = ("vllm", "sglang", "trtllm")
WEIGHT_NAMES = (
    "queue",
    "kvCache",
    "prefix",
    "lru",
    "loraAffinity",
    "runningRequests",
    "predictedLatency",
)
FAILURE_MODES = ("closed", "open")
METRICS_SOURCES = ("scrape", "prometheus")
COORDINATION_SCHEMES = ("redis", "rediss")
TENANT_FAILURE_MODES = ("open", "closed")
# Tenants are metric labels and limit keys: bounded in number, plain in spelling.
MAX_TENANTS = 1000
_TENANT_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")
# A JWT claim name (jwt_authn's claim_name; nested claims are dotted).
_CLAIM_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
T = TypeVar("T")


def is_tenant_name(name: object) -> bool:
    """1-64 letters, digits, '.', '_', '-', starting and ending with a letter or digit."""
    return isinstance(name, str) and _TENANT_RE.match(name) is not None


class ConfigError(ValueError):
    """A config problem, worded as one line that names the offending field."""


@dataclass(frozen=True, kw_only=True)
class TlsConfig:
    """Certificate for the HTTPS listener; empty means a generated self-signed one."""

    certificate_file: str | None = None
    key_file: str | None = None
    secret_name: str | None = None
    # Client certificates signed by this CA are verified (mutual TLS): the load summary
    # is then served only to a verified client (the global router); other clients still
    # connect for inference unless `require_client_certificate`.
    client_ca_file: str | None = None
    require_client_certificate: bool = False


@dataclass(frozen=True, kw_only=True)
class BbrConfig:
    enabled: bool = False
    max_request_body_bytes: int = MAX_BODY_BYTES


@dataclass(frozen=True, kw_only=True)
class JwtConfig:
    issuer: str
    audiences: tuple[str, ...] = ()
    jwks_uri: str | None = None
    jwks_file: str | None = None


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where a pool's live signals come from and how fresh they must be."""

    source: str = "scrape"
    interval_s: float = 0.05
    timeout_s: float = 0.5
    stale_after_s: float = 2.0
    path: str = "/metrics"
    prometheus_url: str | None = None


@dataclass(frozen=True, kw_only=True)
class SaturationConfig:
    """When a pod counts as saturated, and what the gateway does when all are."""

    queue_threshold: int = 8
    kv_cache_threshold: float = 0.9
    queue_size: int = 256
    queue_timeout_s: float = 10.0
    # Flow control (picker.scheduling.flow): a pod is sent a request only while the
    # uncached prompt tokens it has been sent and not yet prefilled, at its learned
    # prefill speed, take at most this long, so a dispatched request starts within it.
    # "0s" turns flow control off, slots and tenants' shares of them included
    # (admission then judges the scraped engine queue alone).
    max_start_delay_s: float = 2.0
    # A pod whose batch slots are learned (picker.scheduling.state.PoolState.slot_limits)
    # is sent a request only while the gateway's requests in flight there are fewer
    # than its slots plus this many, so the excess waits in the gateway's fair queue,
    # not the engine's FCFS one (1: an underestimated limit can still be seen to rise).
    slot_allowance: int = 1
    # While more than one tenant sent a pool a request within this window (or has one
    # in flight), each may hold at most its weighted share of the pool's learned slots
    # (picker.scheduling.shares). "0s" turns the shares off.
    fair_share_window_s: float = 5.0


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """One model's pool: which pods serve it and how the picker scores them."""

    name: str
    model_name: str
    match_labels: dict[str, str] = field(default_factory=dict)
    target_port: int = 8000
    scheduler: str = "llm-d"
    engine_type: str = "vllm"
    weights: dict[str, float] = field(default_factory=dict)
    lora_adapters: tuple[str, ...] = ()
    route_timeout_s: float = 300.0
    replicas: int = 1
    endpoints: tuple[str, ...] = ()
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)


@dataclass(frozen=True, kw_only=True)
class CoordinationConfig:
    """Shared routing state between gateway replicas, through Redis (docs/coordination.md).

    Absent (`GatewayConfig.coordination is None`): each replica routes on what
    it sees alone, exactly as a single gateway does.
    """

    # redis://HOST:PORT/DB, or rediss:// for TLS.
    url: str
    # A file whose whole content (trailing newline stripped) is the password: a
    # mounted Kubernetes Secret is such a file. Read at start, never logged.
    password_file: str | None = None
    # ACL user (Redis 6+ ACLs, ElastiCache RBAC) the password belongs to; None: `default`.
    username: str | None = None
    # PEM bundle of the CA that signed the server's certificate (rediss:// with a private
    # CA); None: the system trust store, which verifies ElastiCache's certificates.
    ca_file: str | None = None
    # Prefix of every key; None: derived from metadata (`GatewayConfig.coordination_prefix`).
    key_prefix: str | None = None
    # How long a dispatch or completion waits locally to be batched with others.
    flush_interval_s: float = 0.01
    # How often a replica says it is alive (an empty batch when nothing else was sent).
    heartbeat_interval_s: float = 1.0
    # Silence after which a replica counts as dead and its in-flight work is released.
    replica_timeout_s: float = 5.0
    # Deadline of every Redis call, connecting included.
    timeout_s: float = 0.25
    # Entries (batches) the shared stream keeps (XADD MAXLEN ~): bounds Redis memory.
    stream_max_len: int = 10_000
    # Events held locally while Redis is slow or down; the oldest is dropped beyond it.
    buffer_size: int = 8192
    # How often a replica stores the prefix-index and adapter snapshot late joiners read.
    snapshot_interval_s: float = 30.0
    # One live replica scrapes each pod and publishes the parsed numbers to the others
    # (picker.coordination.scrapes); False: every replica scrapes every pod itself.
    share_scrapes: bool = True


@dataclass(frozen=True, kw_only=True)
class RateLimits:
    """One tenant's (or one tenant x model's) limits; None: that dimension is unlimited.

    Tokens are what admission reserves: prompt tokens plus `max_tokens`.
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


@dataclass(frozen=True, kw_only=True)
class TenantConfig:
    """One tenant: its fair-share weight, its limits, and tighter limits per model."""

    name: str
    # Relative share of a saturated pool's admission between tenants (flow control).
    weight: float = 1.0
    limits: RateLimits = field(default_factory=RateLimits)
    # Requested model name (a pool's modelName or one of its loraAdapters) → limits.
    model_limits: dict[str, RateLimits] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TenantsConfig:
    """Who sends a request, and what each tenant may send (docs/tenants.md).

    Absent (`GatewayConfig.tenants is None`): no identity, no limits, requests
    are served exactly as without tenants.
    """

    tenants: tuple[TenantConfig, ...]
    # API keys (`igw tenants add-key` lines: salted hashes, never the keys); a mounted
    # Kubernetes Secret is such a file. Re-read when it changes.
    keys_file: str | None = None
    # With spec.auth.jwt: the verified token's claim that names the tenant.
    jwt_claim: str | None = None
    # The shared Redis of the limits unreachable: `open` admits on this replica's own
    # counts, `closed` refuses what it cannot check (503).
    failure_mode: str = "open"
    # Envoy counts each response's output tokens and reports them after it ended
    # (igw_envoy.usage): per-tenant output tokens, reservations corrected. Off: neither,
    # and no per-chunk scan in Envoy.
    measure_usage: bool = True

    def limits(self) -> dict[tuple[str, str], RateLimits]:
        """(tenant, model) → limits, model "" for the tenant-wide ones: the limiter's table."""
        table: dict[tuple[str, str], RateLimits] = {}
        for tenant in self.tenants:
            table[(tenant.name, "")] = tenant.limits
            for model, limits in tenant.model_limits.items():
                table[(tenant.name, model)] = limits
        return table


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    schedulers: tuple[SchedulerConfig, ...]
    name: str = "gateway"
    tls: TlsConfig = field(default_factory=TlsConfig)
    bbr: BbrConfig = field(default_factory=BbrConfig)
    jwt: JwtConfig | None = None
    listen_address: str = "0.0.0.0"
    listen_port: int = 8443
    failure_mode: str = "closed"
    picker_port: int = 9002
    admin_port: int = 9003
    metrics_port: int = 9090
    envoy_admin_port: int = 9901
    max_fallbacks: int = 2
    namespace: str = "default"
    coordination: CoordinationConfig | None = None
    tenants: TenantsConfig | None = None

    @property
    def coordination_prefix(self) -> str:
        """Key prefix in the shared Redis: the override, else one per gateway resource."""
        if self.coordination is not None and self.coordination.key_prefix:
            return self.coordination.key_prefix
        return f"igw:{self.namespace}:{self.name}"

    def scheduler_for_model(self, model: str) -> SchedulerConfig | None:
        return next((s for s in self.schedulers if s.model_name == model), None)


class _Fields:
    """A mapping read field by field; what is left unread at the end is an error."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
        self._data = dict(data)
        self.path = path

    def take(self, key: str, default: Any = None) -> Any:
        return self._data.pop(key, default)

    def has(self, key: str) -> bool:
        return key in self._data

    def remaining(self) -> list[Any]:
        """The keys not taken yet (a mapping whose keys are user names, not fields)."""
        return sorted(self._data, key=str)

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def done(self) -> None:
        if self._data:
            key = sorted(self._data)[0]
            raise ConfigError(f"{self.at(key)}: unknown field")


def parse_duration(value: Any, path: str) -> float:
    """Seconds from `30s`, `500ms`, `2m` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a duration like '30s', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION_RE.match(str(value).strip())
        if not match:
            raise ConfigError(f"{path}: expected a duration like '30s' or '500ms', got {value!r}")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds <= 0:
        raise ConfigError(f"{path}: must be positive, got {value!r}")
    return seconds


def _typed(value: Any, kind: type | tuple[type, ...], path: str) -> Any:
    if isinstance(value, bool) and kind is not bool and bool not in _as_tuple(kind):
        raise ConfigError(f"{path}: expected {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise ConfigError(f"{path}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    if isinstance(kind, types.UnionType):  # `int | float`: name each member
        return kind.__args__
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _port(value: Any, path: str) -> int:
    _typed(value, int, path)
    if not 1 <= value <= 65535:
        raise ConfigError(f"{path}: port must be 1-65535, got {value}")
    return value


def _choice(value: Any, choices: tuple[str, ...], path: str) -> str:
    if value not in choices:
        raise ConfigError(f"{path}: must be one of {', '.join(choices)}; got {value!r}")
    return value


def _number(value: Any, path: str, low: float, high: float) -> float:
    _typed(value, int | float, path)
    if not low <= value <= high:
        raise ConfigError(f"{path}: must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _endpoint(value: Any, path: str) -> str:
    """`host:port` (or `[v6]:port`); the host is kept as written for Envoy to resolve."""
    _typed(value, str, path)
    try:
        return check_endpoint(value)
    except EndpointError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _tls(data: Any, path: str) -> TlsConfig:
    f = _Fields(data, path)
    cert = f.take("certificateFile")
    key = f.take("keyFile")
    secret = f.take("secretName")
    client_ca = f.take("clientCaFile")
    require = _typed(f.take("requireClientCertificate", False), bool,
                     f.at("requireClientCertificate"))
    f.done()
    if (cert is None) != (key is None):
        raise ConfigError(f"{path}: certificateFile and keyFile must be given together")
    for name, value in (("certificateFile", cert), ("keyFile", key), ("secretName", secret),
                        ("clientCaFile", client_ca)):
        if value is not None:
            _typed(value, str, f.at(name))
            if not value:
                raise ConfigError(f"{f.at(name)}: expected a non-empty string")
    if require and client_ca is None:
        raise ConfigError(f"{f.at('requireClientCertificate')}: needs clientCaFile (the CA "
                          "client certificates are verified with)")
    return TlsConfig(certificate_file=cert, key_file=key, secret_name=secret,
                     client_ca_file=client_ca, require_client_certificate=require)


def _bbr(data: Any, path: str) -> BbrConfig:
    f = _Fields(data, path)
    d = BbrConfig()
    enabled = _typed(f.take("enabled", d.enabled), bool, f.at("enabled"))
    limit = f.take("maxRequestBodyBytes", d.max_request_body_bytes)
    _typed(limit, int, f.at("maxRequestBodyBytes"))
    if not 1024 <= limit <= MAX_BODY_BYTES:
        raise ConfigError(
            f"{f.at('maxRequestBodyBytes')}: must be between 1024 and {MAX_BODY_BYTES}, got {limit}"
        )
    f.done()
    return BbrConfig(enabled=enabled, max_request_body_bytes=limit)


def _auth(data: Any, path: str) -> JwtConfig | None:
    f = _Fields(data, path)
    jwt = f.take("jwt")
    f.done()
    if jwt is None:
        return None
    j = _Fields(jwt, f.at("jwt"))
    issuer = _typed(j.take("issuer"), str, j.at("issuer"))
    audiences = j.take("audiences", [])
    _typed(audiences, list, j.at("audiences"))
    for i, aud in enumerate(audiences):
        _typed(aud, str, f"{j.at('audiences')}[{i}]")
    uri = j.take("jwksUri")
    file = j.take("jwksFile")
    j.done()
    if (uri is None) == (file is None):
        raise ConfigError(f"{j.path}: exactly one of jwksUri or jwksFile is required")
    return JwtConfig(issuer=issuer, audiences=tuple(audiences), jwks_uri=uri, jwks_file=file)


def _metrics(data: Any, path: str) -> MetricsConfig:
    f = _Fields(data, path)
    d = MetricsConfig()
    source = _choice(f.take("source", d.source), METRICS_SOURCES, f.at("source"))
    interval = parse_duration(f.take("interval", d.interval_s), f.at("interval"))
    timeout = parse_duration(f.take("timeout", d.timeout_s), f.at("timeout"))
    stale = parse_duration(f.take("staleAfter", d.stale_after_s), f.at("staleAfter"))
    metrics_path = _typed(f.take("path", d.path), str, f.at("path"))
    url = f.take("prometheusUrl")
    f.done()
    if source == "prometheus" and not url:
        raise ConfigError(f"{f.at('prometheusUrl')}: required when source is prometheus")
    if url is not None:
        _typed(url, str, f.at("prometheusUrl"))
    if stale <= interval:
        raise ConfigError(f"{f.at('staleAfter')}: must be longer than interval")
    return MetricsConfig(
        source=source,
        interval_s=interval,
        timeout_s=timeout,
        stale_after_s=stale,
        path=metrics_path,
        prometheus_url=url,
    )


def _saturation(data: Any, path: str) -> SaturationConfig:
    f = _Fields(data, path)
    d = SaturationConfig()
    queue = _typed(f.take("queueThreshold", d.queue_threshold), int, f.at("queueThreshold"))
    kv = _number(f.take("kvCacheThreshold", d.kv_cache_threshold), f.at("kvCacheThreshold"), 0, 1)
    size = _typed(f.take("queueSize", d.queue_size), int, f.at("queueSize"))
    timeout = parse_duration(f.take("queueTimeout", d.queue_timeout_s), f.at("queueTimeout"))
    delay = _duration_or_off(f, "maxStartDelay", d.max_start_delay_s)
    allowance = _typed(f.take("slotAllowance", d.slot_allowance), int, f.at("slotAllowance"))
    window = _duration_or_off(f, "fairShareWindow", d.fair_share_window_s)
    f.done()
    if queue < 0 or size < 0:
        raise ConfigError(f"{path}: queueThreshold and queueSize must not be negative")
    if allowance < 0:
        raise ConfigError(f"{f.at('slotAllowance')}: must not be negative, got {allowance}")
    return SaturationConfig(
        queue_threshold=queue,
        kv_cache_threshold=kv,
        queue_size=size,
        queue_timeout_s=timeout,
        max_start_delay_s=delay,
        slot_allowance=allowance,
        fair_share_window_s=window,
    )


def _duration_or_off(f: _Fields, name: str, default: float) -> float:
    """A positive duration, or 0 for "0s" / "0ms" / 0 (the feature turned off)."""
    raw = f.take(name, default)
    if not isinstance(raw, bool) and raw in (0, "0s", "0ms"):
        return 0.0
    return parse_duration(raw, f.at(name))


def _weights(data: Any, path: str) -> dict[str, float]:
    f = _Fields(data, path)
    weights = {}
    for name in WEIGHT_NAMES:
        if f.has(name):
            weights[name] = _number(f.take(name), f.at(name), 0, 1000)
    f.done()
    return weights


def _model_selector(data: Any, path: str) -> dict[str, str]:
    f = _Fields(data, path)
    labels = f.take("matchLabels", {})
    f.done()
    _typed(labels, dict, f.at("matchLabels"))
    for key, value in labels.items():
        _typed(value, str, f"{f.at('matchLabels')}.{key}")
    return dict(labels)


def _string_list(data: Any, path: str) -> tuple[str, ...]:
    _typed(data, list, path)
    return tuple(_typed(v, str, f"{path}[{i}]") for i, v in enumerate(data))


def _scheduler(data: Any, path: str) -> SchedulerConfig:
    f = _Fields(data, path)
    name = _typed(f.take("name"), str, f.at("name"))
    if not _NAME_RE.match(name):
        raise ConfigError(
            f"{f.at('name')}: must be a DNS label (lower-case, digits, '-'): {name!r}"
        )
    model = f.take("modelName")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{f.at('modelName')}: required, a non-empty string")
    labels = _model_selector(f.take("modelSelector"), f.at("modelSelector"))
    d = SchedulerConfig(name=name, model_name=model)
    port = _port(f.take("targetPort", d.target_port), f.at("targetPort"))
    profile = _choice(f.take("scheduler", d.scheduler), SCHEDULER_PROFILES, f.at("scheduler"))
    engine = _choice(f.take("engineType", d.engine_type), ENGINE_TYPES, f.at("engineType"))
    weights = _weights(f.take("weights"), f.at("weights"))
    adapters = _string_list(f.take("loraAdapters", []), f.at("loraAdapters"))
    timeout = parse_duration(f.take("routeTimeout", d.route_timeout_s), f.at("routeTimeout"))
    replicas = _typed(f.take("replicas", d.replicas), int, f.at("replicas"))
    endpoints_raw = f.take("endpoints", [])
    _typed(endpoints_raw, list, f.at("endpoints"))
    endpoints = tuple(
        _endpoint(e, f"{f.at('endpoints')}[{i}]") for i, e in enumerate(endpoints_raw)
    )
    metrics = _metrics(f.take("metrics"), f.at("metrics"))
    saturation = _saturation(f.take("saturation"), f.at("saturation"))
    f.done()
    if not labels and not endpoints:
        raise ConfigError(f"{path}: needs modelSelector.matchLabels or endpoints")
    return SchedulerConfig(
        name=name,
        model_name=model,
        match_labels=labels,
        target_port=port,
        scheduler=profile,
        engine_type=engine,
        weights=weights,
        lora_adapters=adapters,
        route_timeout_s=timeout,
        replicas=replicas,
        endpoints=endpoints,
        metrics=metrics,
        saturation=saturation,
    )


def parse_list(data: Any, path: str, parse: Callable[[Any, str], T], most: int, what: str
               ) -> tuple[T, ...]:
    """A required, non-empty list of at most `most` entries, each parsed by
    `parse(entry, "path[i]")`."""
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{path}: required, a non-empty list of {what}")
    if len(data) > most:
        raise ConfigError(f"{path}: at most {most} {what}, got {len(data)}")
    return tuple(parse(entry, f"{path}[{i}]") for i, entry in enumerate(data))


def _schedulers(data: Any, path: str) -> tuple[SchedulerConfig, ...]:
    schedulers = parse_list(data, path, _scheduler, MAX_SCHEDULERS, "schedulers")
    _check_unique(schedulers, path)
    return schedulers


def _check_unique(schedulers: tuple[SchedulerConfig, ...], path: str) -> None:
    """Names, model names and adapter names must each map to exactly one pool."""
    seen_names: dict[str, int] = {}
    seen_models: dict[str, str] = {}
    for i, s in enumerate(schedulers):
        if s.name in seen_names:
            raise ConfigError(
                f"{path}[{i}].name: duplicate {s.name!r} (also {path}[{seen_names[s.name]}])"
            )
        seen_names[s.name] = i
        for j, model in enumerate((s.model_name, *s.lora_adapters)):
            where = f"{path}[{i}].modelName" if j == 0 else f"{path}[{i}].loraAdapters[{j - 1}]"
            if model in seen_models:
                raise ConfigError(f"{where}: duplicate model {model!r} (also {seen_models[model]})")
            seen_models[model] = where


def _optional_text(f: _Fields, name: str) -> str | None:
    value = f.take(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{f.at(name)}: expected a non-empty string")
    return value


def _coordination(data: Any, path: str) -> CoordinationConfig | None:
    if data is None:
        return None
    f = _Fields(data, path)
    url = f.take("url")
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{f.at('url')}: required, redis://HOST:PORT/DB or rediss://...")
    scheme = url.partition("://")[0]
    if "://" not in url or scheme not in COORDINATION_SCHEMES:
        raise ConfigError(
            f"{f.at('url')}: scheme must be one of {', '.join(COORDINATION_SCHEMES)}; got {url!r}"
        )
    d = CoordinationConfig(url=url)
    password_file = _optional_text(f, "passwordFile")
    username = _optional_text(f, "username")
    ca_file = _optional_text(f, "caFile")
    if ca_file is not None and scheme != "rediss":
        raise ConfigError(f"{f.at('caFile')}: only with a rediss:// url (TLS); got {url!r}")
    prefix = _optional_text(f, "keyPrefix")
    flush = parse_duration(f.take("flushInterval", d.flush_interval_s), f.at("flushInterval"))
    heartbeat = parse_duration(
        f.take("heartbeatInterval", d.heartbeat_interval_s), f.at("heartbeatInterval")
    )
    dead = parse_duration(f.take("replicaTimeout", d.replica_timeout_s), f.at("replicaTimeout"))
    timeout = parse_duration(f.take("timeout", d.timeout_s), f.at("timeout"))
    snapshot = parse_duration(
        f.take("snapshotInterval", d.snapshot_interval_s), f.at("snapshotInterval")
    )
    max_len = _typed(f.take("streamMaxLen", d.stream_max_len), int, f.at("streamMaxLen"))
    buffer = _typed(f.take("bufferSize", d.buffer_size), int, f.at("bufferSize"))
    share = _typed(f.take("shareScrapes", d.share_scrapes), bool, f.at("shareScrapes"))
    f.done()
    if flush > 1.0:
        raise ConfigError(f"{f.at('flushInterval')}: at most 1s, got {flush:g}s")
    if dead <= 2 * heartbeat:
        raise ConfigError(f"{f.at('replicaTimeout')}: must exceed twice heartbeatInterval")
    if not 100 <= max_len <= 10_000_000:
        raise ConfigError(f"{f.at('streamMaxLen')}: must be between 100 and 10000000")
    if not 64 <= buffer <= 1_000_000:
        raise ConfigError(f"{f.at('bufferSize')}: must be between 64 and 1000000")
    return CoordinationConfig(
        url=url,
        password_file=password_file,
        username=username,
        ca_file=ca_file,
        key_prefix=prefix,
        flush_interval_s=flush,
        heartbeat_interval_s=heartbeat,
        replica_timeout_s=dead,
        timeout_s=timeout,
        stream_max_len=max_len,
        buffer_size=buffer,
        snapshot_interval_s=snapshot,
        share_scrapes=share,
    )


def _rate_limits(data: Any, path: str) -> RateLimits:
    """`requestsPerMinute`, `tokensPerMinute`, `maxConcurrentRequests`: each a positive
    integer, absent for unlimited."""
    f = _Fields(data, path)
    values = {}
    for key, name in (
        ("requestsPerMinute", "requests_per_minute"),
        ("tokensPerMinute", "tokens_per_minute"),
        ("maxConcurrentRequests", "max_concurrent_requests"),
    ):
        value = f.take(key)
        if value is not None:
            _typed(value, int, f.at(key))
            if not 1 <= value <= 10**12:
                raise ConfigError(f"{f.at(key)}: must be between 1 and 10^12, got {value}")
        values[name] = value
    f.done()
    return RateLimits(**values)


def model_mapping(data: Any, path: str, parse: Callable[[Any, str], T]) -> dict[str, T]:
    """A mapping keyed by requested model names (non-empty strings), each value parsed by
    `parse(value, path)`: a tenant's `modelLimits`, a region's `costs`."""
    models = _Fields(data, path)
    out = {}
    for model in models.remaining():
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{models.path}: model names must be non-empty strings: {model!r}")
        out[model] = parse(models.take(model), models.at(model))
    return out


def check_unique(items: tuple[Any, ...], attr: str, path: str, field_name: str) -> None:
    """No two `items` share `getattr(item, attr)`; the error names both places."""
    seen: dict[Any, int] = {}
    for i, item in enumerate(items):
        value = getattr(item, attr)
        if value in seen:
            raise ConfigError(
                f"{path}[{i}].{field_name}: duplicate {value!r} (also {path}[{seen[value]}])"
            )
        seen[value] = i


def _tenant(data: Any, path: str) -> TenantConfig:
    f = _Fields(data, path)
    name = f.take("name")
    if not is_tenant_name(name):
        raise ConfigError(
            f"{f.at('name')}: required, 1-64 letters, digits, '.', '_', '-' "
            f"(starting and ending with a letter or digit); got {name!r}"
        )
    d = TenantConfig(name=name)
    weight = _number(f.take("weight", d.weight), f.at("weight"), 0.001, 1000)
    limits = _rate_limits(f.take("limits"), f.at("limits"))
    model_limits = model_mapping(f.take("modelLimits"), f.at("modelLimits"), _rate_limits)
    f.done()
    return TenantConfig(name=name, weight=weight, limits=limits, model_limits=model_limits)


def _tenants(data: Any, path: str) -> TenantsConfig | None:
    if data is None:
        return None
    f = _Fields(data, path)
    d = TenantsConfig(tenants=())
    keys_file = _optional_text(f, "keysFile")
    claim = _optional_text(f, "jwtClaim")
    if claim is not None and not _CLAIM_RE.match(claim):
        raise ConfigError(f"{f.at('jwtClaim')}: not a claim name: {claim!r}")
    failure = _choice(
        f.take("failureMode", d.failure_mode), TENANT_FAILURE_MODES, f.at("failureMode")
    )
    measure = _typed(f.take("measureUsage", d.measure_usage), bool, f.at("measureUsage"))
    raw = f.take("list")
    f.done()
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{f.at('list')}: required, a non-empty list of tenants")
    if len(raw) > MAX_TENANTS:
        raise ConfigError(f"{f.at('list')}: at most {MAX_TENANTS} tenants, got {len(raw)}")
    tenants = tuple(_tenant(t, f"{f.at('list')}[{i}]") for i, t in enumerate(raw))
    check_unique(tenants, "name", f.at("list"), "name")
    if (keys_file is None) == (claim is None):
        raise ConfigError(f"{path}: exactly one of keysFile or jwtClaim is required")
    return TenantsConfig(
        tenants=tenants, keys_file=keys_file, jwt_claim=claim, failure_mode=failure,
        measure_usage=measure,
    )


def _check_tenants(
    tenants: TenantsConfig, jwt: JwtConfig | None, schedulers: tuple[SchedulerConfig, ...]
) -> None:
    """What only the whole spec can tell; per-model limits name served models."""
    served = {name for s in schedulers for name in (s.model_name, *s.lora_adapters)}
    check_tenancy(tenants, jwt, served,
                  "no scheduler serves this model (a modelName or loraAdapters entry)")


def check_tenancy(tenants: TenantsConfig, jwt: JwtConfig | None, models: set[str],
                  unknown_model: str) -> None:
    """spec.tenants against the rest of a spec (a gateway's or the global router's): the
    claim needs JWT, API keys exclude it (both are `Authorization: Bearer`), and every
    per-model limit names one of `models` (else `unknown_model` says why not)."""
    if tenants.jwt_claim is not None and jwt is None:
        raise ConfigError("spec.tenants.jwtClaim: needs spec.auth.jwt (the verified token)")
    if tenants.keys_file is not None and jwt is not None:
        raise ConfigError(
            "spec.tenants.keysFile: not with spec.auth.jwt (both are `Authorization: Bearer`); "
            "use jwtClaim to name the tenant from the token"
        )
    for i, tenant in enumerate(tenants.tenants):
        for model in tenant.model_limits:
            if model not in models:
                raise ConfigError(f"spec.tenants.list[{i}].modelLimits.{model}: {unknown_model}")


def listener_fields(f: _Fields, address: str, port: int) -> tuple[str, int]:
    """`listener: {address, port}` of a spec (the gateway's and the global router's):
    an IP address and a port, defaulting to the given ones."""
    listener = _Fields(f.take("listener"), f.at("listener"))
    address = _typed(listener.take("address", address), str, listener.at("address"))
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ConfigError(f"{listener.at('address')}: not an IP address: {address!r}") from None
    port = _port(listener.take("port", port), listener.at("port"))
    listener.done()
    return address, port


def _gateway_fields(f: _Fields) -> dict[str, Any]:
    """Our additions at spec level, for running outside Kubernetes."""
    d = GatewayConfig(schedulers=())
    address, port = listener_fields(f, d.listen_address, d.listen_port)
    ports = _Fields(f.take("ports"), f.at("ports"))
    picker_port = _port(ports.take("picker", d.picker_port), ports.at("picker"))
    admin_port = _port(ports.take("admin", d.admin_port), ports.at("admin"))
    metrics_port = _port(ports.take("metrics", d.metrics_port), ports.at("metrics"))
    envoy_admin = _port(ports.take("envoyAdmin", d.envoy_admin_port), ports.at("envoyAdmin"))
    ports.done()
    failure = _choice(f.take("failureMode", d.failure_mode), FAILURE_MODES, f.at("failureMode"))
    fallbacks = _typed(f.take("maxFallbacks", d.max_fallbacks), int, f.at("maxFallbacks"))
    if not 0 <= fallbacks <= 8:
        raise ConfigError(f"{f.at('maxFallbacks')}: must be between 0 and 8, got {fallbacks}")
    all_ports = [port, picker_port, admin_port, metrics_port, envoy_admin]
    if len(set(all_ports)) != len(all_ports):
        raise ConfigError(f"{f.path}: listener.port and ports.* must all differ: {all_ports}")
    return {
        "listen_address": address,
        "listen_port": port,
        "picker_port": picker_port,
        "admin_port": admin_port,
        "metrics_port": metrics_port,
        "envoy_admin_port": envoy_admin,
        "failure_mode": failure,
        "max_fallbacks": fallbacks,
        "coordination": _coordination(f.take("coordination"), f.at("coordination")),
        "tenants": _tenants(f.take("tenants"), f.at("tenants")),
    }


# Kubernetes object metadata that says nothing about routing: accepted, not used.
_IGNORED_METADATA = (
    "labels",
    "annotations",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "managedFields",
)


def metadata_fields(top: _Fields, name: str, namespace: str) -> tuple[str, str]:
    """`metadata.name` and `metadata.namespace` (Kubernetes' other metadata ignored)."""
    meta = _Fields(top.take("metadata"), "metadata")
    name = _typed(meta.take("name", name), str, "metadata.name")
    namespace = _typed(meta.take("namespace", namespace), str, "metadata.namespace")
    for ignored in _IGNORED_METADATA:
        meta.take(ignored)
    meta.done()
    return name, namespace


def open_document(doc: Any, kind: str, name: str, namespace: str) -> tuple[str, str, _Fields]:
    """Check `apiVersion` and `kind`, read the metadata (defaults: `name`, `namespace`),
    and return them with the `spec` mapping to read field by field (`status` ignored)."""
    top = _Fields(doc, "")
    api = top.take("apiVersion")
    if api not in API_VERSIONS:
        raise ConfigError(f"apiVersion: must be one of {', '.join(API_VERSIONS)}; got {api!r}")
    if top.take("kind") != kind:
        raise ConfigError(f"kind: must be {kind}")
    name, namespace = metadata_fields(top, name, namespace)
    top.take("status")
    spec = _Fields(top.take("spec"), "spec")
    top.done()
    return name, namespace, spec


def parse_config(doc: Any) -> GatewayConfig:
    """Build a validated config from a parsed YAML/JSON document."""
    d = GatewayConfig(schedulers=())
    name, namespace, spec = open_document(doc, KIND, d.name, d.namespace)
    tls = _tls(spec.take("tls"), "spec.tls")
    bbr = _bbr(spec.take("bbr"), "spec.bbr")
    jwt = _auth(spec.take("auth"), "spec.auth")
    schedulers = _schedulers(spec.take("schedulers"), "spec.schedulers")
    extra = _gateway_fields(spec)
    spec.done()
    if len(schedulers) > 1 and not bbr.enabled:
        raise ConfigError("spec.bbr.enabled: must be true when there is more than one scheduler")
    if extra["tenants"] is not None:
        _check_tenants(extra["tenants"], jwt, schedulers)
    return GatewayConfig(
        name=name, namespace=namespace, schedulers=schedulers, tls=tls, bbr=bbr, jwt=jwt, **extra
    )


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a config file; every problem is a one-line ConfigError."""
    return load_config_text(read_text(path))


def read_text(path: str | Path) -> str:
    """A config file's text, or a ConfigError naming the file."""
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None


def yaml_document(text: str) -> Any:
    """The parsed YAML document, or a ConfigError naming the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None


def load_config_text(text: str) -> GatewayConfig:
    return parse_config(yaml_document(text))
