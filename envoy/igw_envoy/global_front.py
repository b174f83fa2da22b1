"""The global router's Envoy: a TLS front door whose upstreams are regions (docs/global.md).

The same listener, filter chain and ext_proc contract as Tier 1 (igw_envoy.listener,
igw_envoy.http_filters), with one upstream cluster, `regions`: every region's Tier-1
listener is a member, reached over TLS verified with that region's CA
(`transport_socket_matches` picks the region's TLS context by the endpoint's
metadata). The global router answers the regions to try, best first, and the
`override_host` policy hands the n-th address to the n-th attempt, so a retry
goes to the next region. Why one cluster and not one per region: a route's
retries stay within its cluster, and an aggregate cluster tries its members in
a fixed priority order, not the router's per-request one.

Retries (before any response byte reached the client): connect failure, reset,
refused stream, and a 503 or 429 from the region (no ready pod, saturated, shed). A
partitioned region's connections are closed by HTTP/2 keepalive PINGs (KEEPALIVE), which
resets its requests, so they are retried too; no per-try timeout cuts a long request.
Outlier detection and an active health check on the load-summary path (which a
draining Tier-1 answers 503) take a dead region out of Envoy's own fallback
balancing (the router is down or fail-open); the router itself stops placing on
a region whose poll fails. Every answer from a region carries `x-gateway-region`
from that region's endpoint metadata: the region that served it, retried or not.
"""

from __future__ import annotations

from pathlib import Path

from bbr.request import API_PATHS
from contract import headers
from contract.endpoints import split_endpoint
from contract.global_config import (
    ClientCertificate,
    GlobalRouterConfig,
    RegionConfig,
    region_address,
)
from igw_envoy import replies
from igw_envoy.clusters import (
    CIRCUIT_LIMIT,
    POOL_CONNECT_TIMEOUT,
    UPSTREAM_HTTP_OPTIONS,
    override_host_policy,
    picker_cluster,
    static_assignment,
)
from igw_envoy.http_filters import (
    ext_proc_filter_for,
    hold_filter_for,
    router_filter,
    strip_filter,
)
from igw_envoy.jwt import jwks_cluster, jwt_filter, system_ca_bundle
from igw_envoy.listener import connection_manager_base, https_listener
from igw_envoy.render import (
    RenderPaths,
    default_paths,
    ensure_certificate,
    overload_manager,
    to_yaml,
)
from igw_envoy.routes import (
    health_route,
    one_message_route_for,
    rate_limit_headers,
    retry_policy,
)
from igw_envoy.sds import write_secret
from igw_envoy.tls import reload_dir
from igw_envoy.upstream_tls import upstream_tls

REGIONS_CLUSTER = "regions"
# Endpoint metadata namespace naming each region (for `x-gateway-region`).
REGION_METADATA = "igw"
TRANSPORT_MATCH = "envoy.transport_socket_match"
RETRY_ON = "connect-failure,reset,refused-stream,retriable-status-codes"
RETRIABLE_STATUSES = (503, 429)
# Requests to a region may stream for minutes (long generations).
ROUTE_TIMEOUT_S = 600.0
HEALTH_INTERVAL = "1s"
# A partitioned region (packets dropped, nothing closed) is found by HTTP/2 PINGs on each
# connection to it: one a second, and the connection is closed when nothing at all (Envoy
# extends the wait on any frame received) arrives for 1.5 s after one. Its requests that
# had no response byte yet are then reset and retried on the next region. Not a per-try
# timer: a TTFT of many seconds is legitimate and a connection that answers PINGs is not
# cut; 1.5 s is well above real inter-region RTTs (and twice a region slowed to 800 ms).
KEEPALIVE = {"interval": "1s", "timeout": "1.5s"}


def region_tls(region: RegionConfig, client: ClientCertificate | None = None) -> dict:
    """TLS to one region: its CA (else the system store), its server name checked, h2;
    the router's certificate presented with `spec.regionClientTls` (mutual TLS)."""
    host = region.server_name or split_endpoint(region.endpoint)[0]
    socket = upstream_tls(host, region.ca_file or system_ca_bundle(), alpn=["h2"])
    if client is not None:
        socket["typed_config"]["common_tls_context"]["tls_certificates"] = [{
            "certificate_chain": {"filename": client.certificate_file},
            "private_key": {"filename": client.key_file},
        }]
    return socket


def regions_cluster(config: GlobalRouterConfig) -> dict:
    """Every region's Tier-1 listener, in config order, each with its own TLS."""
    hosts, metadata = [], []
    for region in config.regions:
        host, port = split_endpoint(region_address(region))
        hosts.append((host, port))
        metadata.append({"filter_metadata": {
            REGION_METADATA: {"region": region.name},
            TRANSPORT_MATCH: {"region": region.name},
        }})
    return {
        "name": REGIONS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": POOL_CONNECT_TIMEOUT,
        "per_connection_buffer_limit_bytes": config.bbr.max_request_body_bytes,
        "load_balancing_policy": override_host_policy(),
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT",
            "max_connections": CIRCUIT_LIMIT,
            "max_pending_requests": CIRCUIT_LIMIT,
            "max_requests": CIRCUIT_LIMIT,
            "max_retries": CIRCUIT_LIMIT,
        }]},
        "typed_extension_protocol_options": {
            UPSTREAM_HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
                "explicit_http_config": {
                    "http2_protocol_options": {"connection_keepalive": KEEPALIVE}
                },
            }
        },
        "transport_socket_matches": [
            {"name": r.name, "match": {"region": r.name},
             "transport_socket": region_tls(r, config.region_client_tls)}
            for r in config.regions
        ],
        "load_assignment": static_assignment(REGIONS_CLUSTER, hosts, metadata),
        "outlier_detection": {
            # A region that fails twice in a row is out of the fallback balancing for
            # 5 s (longer each time); one region always stays eligible.
            "consecutive_5xx": 2,
            "consecutive_gateway_failure": 2,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_time": "60s",
            "max_ejection_percent": 67,
        },
        "health_checks": [{
            "timeout": "1s",
            "interval": HEALTH_INTERVAL,
            # Envoy's default for a cluster without traffic is one check a minute: a
            # region that failed its first check at start-up would stay out that long.
            "no_traffic_interval": HEALTH_INTERVAL,
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "http_health_check": {
                "path": headers.LOAD_SUMMARY_PATH,
                "codec_client_type": "HTTP2",
            },
        }],
    }


def region_route_action(config: GlobalRouterConfig) -> dict:
    """To the regions the router answered, the next one on each retry."""
    action: dict = {"cluster": REGIONS_CLUSTER, "timeout": f"{ROUTE_TIMEOUT_S:g}s"}
    if config.max_retries > 0:
        policy = retry_policy(config.max_retries)
        policy["retry_on"] = RETRY_ON
        policy["retriable_status_codes"] = list(RETRIABLE_STATUSES)
        action["retry_policy"] = policy
    return action


def served_by() -> list[dict]:
    """`x-gateway-region`: the name in the metadata of the endpoint that answered."""
    return [{
        "header": {
            "key": headers.REGION,
            "value": f"%UPSTREAM_METADATA({REGION_METADATA}:region)%",
        },
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }]


def global_route_config(config: GlobalRouterConfig) -> dict:
    """Health, the one-message inference routes, then everything else (two messages:
    the router answers what the headers alone decide, as Tier 1's picker does)."""
    limit = config.bbr.max_request_body_bytes
    answer = served_by()
    if config.tenants is not None:
        answer += rate_limit_headers()
    action = {"route": region_route_action(config), "response_headers_to_add": answer}
    routes = [health_route()]
    routes += [one_message_route_for(limit, path, action) for path in API_PATHS]
    routes.append({"name": "regions", "match": {"prefix": "/"}, **action})
    host: dict = {"name": "global", "domains": ["*"], "routes": routes}
    if config.tenants is not None:
        # The key is the global tier's; a region's own credentials are its business.
        host["request_headers_to_remove"] = [headers.AUTHORIZATION]
    return {"name": "global", "virtual_hosts": [host]}


def global_listener(config: GlobalRouterConfig, paths: RenderPaths) -> dict:
    limit = config.bbr.max_request_body_bytes
    attributes = [*headers.REQUEST_ATTRIBUTES, *headers.GLOBAL_ATTRIBUTES]
    if config.tenants is not None:
        attributes += headers.TENANT_ATTRIBUTES
    filters = [strip_filter()]
    if config.jwt is not None:  # before ext_proc: a request without a valid token costs nothing
        claim = config.tenants.jwt_claim if config.tenants is not None else None
        filters.append(jwt_filter(config.jwt, None, claim))
    filters += [
        ext_proc_filter_for(config.failure_mode == "open", attributes),
        hold_filter_for(limit),
        router_filter(),
    ]
    hcm = {
        **connection_manager_base(limit, ROUTE_TIMEOUT_S),
        "http_filters": filters,
        "route_config": global_route_config(config),
        "local_reply_config": replies.local_reply_config(limit),
        "access_log": replies.access_log(paths.access_log),
    }
    return https_listener(config.listen_address, config.listen_port, limit, hcm, paths.sds_dir,
                          config.tls)


def render_global_bootstrap(config: GlobalRouterConfig, paths: RenderPaths) -> dict:
    """The whole bootstrap (static: a config change restarts `igw global serve`)."""
    picker_host, _, picker_port = paths.picker_address.rpartition(":")
    node = f"igw-global-{config.name}"
    clusters = [picker_cluster(picker_host.strip("[]"), int(picker_port)),
                regions_cluster(config)]
    if config.jwt is not None and config.jwt.jwks_uri:
        clusters.append(jwks_cluster(config.jwt.jwks_uri))
    return {
        "node": {"id": node, "cluster": node},
        "admin": {"address": {"socket_address": {
            "address": "127.0.0.1", "port_value": config.envoy_admin_port}}},
        "static_resources": {
            "listeners": [global_listener(config, paths)],
            "clusters": clusters,
        },
        "overload_manager": overload_manager(),
    }


def write_global_bootstrap(config: GlobalRouterConfig, state_dir: Path, *,
                           access_log: str | None = None) -> Path:
    """envoy.yaml, the listener certificate (generated when spec.tls names none) and its
    SDS file, into `state_dir`; returns envoy.yaml's path."""
    paths = default_paths(config, state_dir, access_log=access_log)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    tls_files = ensure_certificate(config, paths)
    watched = reload_dir(tls_files.cert.parent) if tls_files.ca_cert is not None else None
    write_secret(paths.sds_dir, paths.cert, paths.key, watched_dir=watched)
    paths.bootstrap.write_text(to_yaml(render_global_bootstrap(config, paths)))
    return paths.bootstrap
