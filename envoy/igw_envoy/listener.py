"""The HTTPS listener: TLS, the HTTP filter chain and the routes.

Filter order is the security argument: client copies of the routing headers
are removed first, then JWT (when configured) rejects unauthenticated
requests, then ext_proc asks the picker, then the router connects to the
pool member the picker named.

The picker answers in `envoy.lb` dynamic metadata, never in request headers
(see `ext_proc_filter`): pool routes match on it, `override_host` reads the
destination from it, and each pool route copies it into the `x-gateway-*`
request headers for the pod and the access log. A client cannot set dynamic
metadata at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bbr.request import API_PATHS
from contract import headers
from contract.config import GatewayConfig, SchedulerConfig
from igw_envoy import replies
from igw_envoy.clusters import PICKER_CLUSTER
from igw_envoy.eds import cluster_name
from igw_envoy.jwt import HEALTH_PATH, jwt_filter
from igw_envoy.sds import sds_config

HCM_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
EXT_PROC_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
HEADER_MUTATION_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)
EARLY_MUTATION_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
TLS_DOWNSTREAM_TYPE = (
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
)
PREVIOUS_HOSTS_TYPE = (
    "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
)
BUFFER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
BUFFER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
LUA_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"
EXT_PROC = "envoy.filters.http.ext_proc"
BUFFER = "envoy.filters.http.buffer"
FALLBACK = "envoy.filters.http.lua"

# TLS 1.2 suites: forward secrecy (ECDHE) and AEAD only. TLS 1.3 suites are
# fixed by BoringSSL and all qualify.
TLS12_CIPHERS = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
)
# Retried on the picker's next address: failures before the pod produced anything
# (no connection, reset, refused stream) and gateway errors (502/503/504: a pod
# that is overloaded or whose engine is down). A plain 500 is not retried: it may
# be the request itself that breaks an engine, and it must not take down the next.
RETRY_ON = "connect-failure,reset,refused-stream,gateway-error"
MESSAGE_TIMEOUT = "2s"
MAX_MESSAGE_TIMEOUT = "60s"
# HTTP/2: Envoy caps what a stream may buffer at the stream's flow-control
# window, not at the connection buffer limit (measured on 1.40: with a 1 MiB
# window a 1.1 MiB body got 413 despite an 8 MiB connection limit). So both
# windows are the body limit (Envoy's own default is 256 MiB, the largest
# body limit the config allows); h2 needs at least 65535.
H2_MIN_WINDOW = 65_535
H2_MAX_STREAMS = 1024


@dataclass(frozen=True)
class ListenerInputs:
    """What the listener needs besides the config: where the certificate's SDS file is."""

    sds_dir: Path
    access_log_path: str | None
    jwt_base_dir: Path | None = None
    # Set: routes come from the watched RDS file under this state dir (igw_envoy.xds);
    # None: routes are inline (a self-contained bootstrap, e.g. for `envoy --mode validate`).
    rds_state_dir: Path | None = None


def listener(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    """The HTTPS listener on listen_address:listen_port."""
    limit = config.bbr.max_request_body_bytes
    socket_address: dict = {"address": config.listen_address, "port_value": config.listen_port}
    if config.listen_address == "::":
        socket_address["ipv4_compat"] = True  # "all addresses" includes IPv4 clients
    return {
        "name": "https",
        "address": {"socket_address": socket_address},
        # A buffered body beyond the connection buffer limit is a 413 from
        # Envoy (1 MiB by default, DESIGN §8): the limit is the body limit.
        "per_connection_buffer_limit_bytes": limit,
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": http_connection_manager(config, inputs),
                    }
                ],
                "transport_socket": downstream_tls(inputs.sds_dir),
            }
        ],
    }


def downstream_tls(sds_dir: Path) -> dict:
    """TLS 1.2+ with modern suites, ALPN h2 and http/1.1, certificate from watched SDS."""
    return downstream_tls_socket({"tls_certificate_sds_secret_configs": [sds_config(sds_dir)]})


def downstream_tls_socket(certificates: dict) -> dict:
    """The listener's TLS policy with the given certificate source (SDS or files);
    the benchmark's plain-Envoy baseline uses it too, so both terminate TLS alike."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TLS_DOWNSTREAM_TYPE,
            "common_tls_context": {
                "tls_params": {
                    "tls_minimum_protocol_version": "TLSv1_2",
                    "tls_maximum_protocol_version": "TLSv1_3",
                    "cipher_suites": list(TLS12_CIPHERS),
                },
                "alpn_protocols": ["h2", "http/1.1"],
                **certificates,
            },
        },
    }


def http_connection_manager(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    longest = max(s.route_timeout_s for s in config.schedulers)
    return {
        "@type": HCM_TYPE,
        "stat_prefix": "ingress_https",
        "codec_type": "AUTO",
        "server_name": "inference-gateway",
        "use_remote_address": True,
        # x-request-id on every response, so a client can quote it and an
        # operator find the access-log line (and the picker's log) for it.
        "always_set_request_id_in_response": True,
        "normalize_path": True,
        "merge_slashes": True,
        "request_headers_timeout": "10s",
        # Streams are idle while a long prompt waits in a queue or prefills;
        # never cut them before the route timeout would.
        "stream_idle_timeout": _duration(max(longest, 300.0)),
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "http2_protocol_options": h2_options(config.bbr.max_request_body_bytes),
        "early_header_mutation_extensions": [early_strip()],
        "http_filters": http_filters(config, inputs),
        **_routes(config, inputs),
        "local_reply_config": replies.local_reply_config(config.bbr.max_request_body_bytes),
        "access_log": replies.access_log(inputs.access_log_path),
    }


def _routes(config: GatewayConfig, inputs: ListenerInputs) -> dict:
    if inputs.rds_state_dir is None:
        return {"route_config": route_config(config)}
    from igw_envoy.xds import rds_config

    return {"rds": rds_config(inputs.rds_state_dir)}


def h2_options(body_limit: int) -> dict:
    """HTTP/2 windows as large as the body limit, so a buffered body up to it fits."""
    window = max(body_limit, H2_MIN_WINDOW)
    return {
        "max_concurrent_streams": H2_MAX_STREAMS,
        "initial_stream_window_size": window,
        "initial_connection_window_size": window,
    }


def _remove_routing_headers() -> list[dict]:
    return [{"remove": name} for name in headers.STRIPPED_HEADERS]


def early_strip() -> dict:
    """Remove client routing headers before Envoy's first route match.

    The header_mutation *filter* runs after the route was already matched
    once on the client's headers; if the picker then sets no pool (fail-open
    with the picker down), that cached match would still follow a client's
    `x-gateway-pool`. Stripping at the early-mutation stage makes the first
    match see clean headers.
    """
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {"@type": EARLY_MUTATION_TYPE, "mutations": _remove_routing_headers()},
    }


def strip_filter() -> dict:
    """header_mutation filter removing client routing headers before ext_proc.

    Route-level request_headers_to_remove would run after the picker and
    remove its header too (DESIGN §8), so the removal is a filter placed
    before ext_proc.
    """
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": HEADER_MUTATION_TYPE,
            "mutations": {"request_mutations": _remove_routing_headers()},
        },
    }


# Request headers, then the buffered body; no response phases (a `one_message_route`
# skips the headers).
PROCESSING_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SKIP",
    "request_body_mode": "BUFFERED",
    "response_body_mode": "NONE",
    "request_trailer_mode": "SKIP",
    "response_trailer_mode": "SKIP",
}


def ext_proc_filter(config: GatewayConfig) -> dict:
    """The picker call: headers then the buffered body (one-message routes: body only).

    What the picker reads from the headers is also requested as attributes
    (`headers.REQUEST_ATTRIBUTES`): on a `one_message_route` Envoy sends no
    headers message, and ext_proc puts the attributes into the first message it
    sends, the body. Measured on 1.40: filter-level `request_attributes` arrive
    with the body message; the per-route `overrides.request_attributes` are
    ignored. They beat `header_to_metadata` + `forwarding_namespaces` (another
    filter, and a Struct per request either way). On the two-message path the
    attributes ride along the headers message, unused.

    The answer is dynamic metadata, not a header mutation: with the headers
    phase skipped Envoy drops header mutations in the body answer ("headers
    aren't available", measured). It clears the route cache only if the answer
    carries a header mutation, so the picker sends an empty one.
    """
    return {
        "name": EXT_PROC,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": config.failure_mode == "open",
            # A dead picker with fail-closed: a fast, retryable 503 (not 500).
            "status_on_error": {"code": "ServiceUnavailable"},
            "processing_mode": PROCESSING_MODE,
            "request_attributes": list(headers.REQUEST_ATTRIBUTES),
            "message_timeout": MESSAGE_TIMEOUT,
            # The picker may hold a request in its admission queue and extend
            # the deadline with override_message_timeout, up to this.
            "max_message_timeout": MAX_MESSAGE_TIMEOUT,
            "allow_mode_override": False,
            # The picker answers in metadata; it may never touch Envoy's routing
            # headers (host, :authority, :scheme, :method) nor x-envoy-*.
            "mutation_rules": {"allow_all_routing": False, "allow_envoy": False},
            "metadata_options": {
                "receiving_namespaces": {"untyped": [headers.LB_METADATA_NAMESPACE]}
            },
        },
    }


def hold_filter(config: GatewayConfig) -> dict:
    """A buffer filter after ext_proc, off unless a route turns it on.

    With the headers phase skipped, ext_proc lets the headers through at once
    and the router would pick the route and the host before the picker saw the
    body (measured: every request got the fallback route). On a
    `one_message_route` this filter holds the headers until the whole body has
    passed ext_proc, so the router matches after the picker's answer.
    """
    return {
        "name": BUFFER,
        "disabled": True,
        "typed_config": {
            "@type": BUFFER_TYPE,
            "max_request_bytes": config.bbr.max_request_body_bytes,
        },
    }


# The body's top-level "model" string, found without a JSON parser (Envoy's Lua has
# none): a quote inside a JSON string is escaped (\"), so `"model"` followed by `:`
# can only be a key; names with escapes or over 256 bytes do not match (503 as before).
FALLBACK_LUA = """
function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then
    return
  end
  local text = body:getBytes(0, body:length())
  local model = string.match(text, '"model"%s*:%s*"([^"\\\\]+)"')
  if model ~= nil and #model <= 256 then
    handle:headers():replace("HEADER", model)
    handle:clearRouteCache()
  end
end
""".replace("HEADER", headers.FALLBACK_MODEL)


def needs_fallback(config: GatewayConfig) -> bool:
    """Fail-open with several pools: without the picker only the body names the pool."""
    return config.failure_mode == "open" and len(config.schedulers) > 1


def fallback_filter() -> dict:
    """Fail-open with several pools and the picker unreachable: route by the body's model.

    With one pool the fallback route needs no model. With several, ext_proc
    failing open leaves no pool chosen; this filter reads the model from the
    body, sets `x-gateway-fallback-model` and clears the route cache, and a
    `fallback_route` per pool sends the request to that pool's pods with
    Envoy's own load balancing. Pool routes (the picker answered) and the
    health route turn it off, so a healthy gateway never runs it.
    """
    return {
        "name": FALLBACK,
        "typed_config": {"@type": LUA_TYPE, "default_source_code": {"inline_string": FALLBACK_LUA}},
    }


def _fallback_off() -> dict:
    return {FALLBACK: {"@type": LUA_ROUTE_TYPE, "disabled": True}}


def router_filter() -> dict:
    return {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}


def http_filters(config: GatewayConfig, inputs: ListenerInputs) -> list[dict]:
    filters = [strip_filter()]
    if config.jwt is not None:
        filters.append(jwt_filter(config.jwt, inputs.jwt_base_dir))
    filters += [ext_proc_filter(config), hold_filter(config)]
    if needs_fallback(config):
        filters.append(fallback_filter())
    filters.append(router_filter())
    return filters


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def retry_policy(max_fallbacks: int) -> dict:
    """Retry connection-level failures on the next host of the picker's list.

    override_host hands the n-th address of `a,b,c` to the n-th attempt;
    previous_hosts keeps the fallback policy from re-picking a failed host
    once the list is used up.
    """
    return {
        "retry_on": RETRY_ON,
        "num_retries": max_fallbacks,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": PREVIOUS_HOSTS_TYPE},
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


def pool_route_action(pool: SchedulerConfig, max_fallbacks: int) -> dict:
    action: dict = {"cluster": cluster_name(pool.name), "timeout": _duration(pool.route_timeout_s)}
    if max_fallbacks > 0:
        action["retry_policy"] = retry_policy(max_fallbacks)
    return action


def health_route() -> dict:
    """Envoy's own liveness: answered by Envoy, without the picker or a token."""
    return {
        "name": "healthz",
        "match": {"path": HEALTH_PATH, "headers": [_exact(":method", "GET")]},
        "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
        "typed_per_filter_config": {EXT_PROC: {"@type": EXT_PROC_ROUTE_TYPE, "disabled": True}},
    }


def _exact(name: str, value: str) -> dict:
    return {"name": name, "string_match": {"exact": value}}


def no_pool_route(config: GatewayConfig) -> dict:
    """Requests the picker did not assign to a pool.

    One pool: Envoy's own least-request over its members (fail-open keeps
    serving). Several: a 503 the client can retry (turned into OpenAI JSON by
    the local-reply mappers); with fail-open, `fallback_filter` first tries the
    body's model (`fallback_routes`), so only a body without a known model
    ends here.
    """
    return {"name": "no_pool", "match": {"prefix": "/"}, **_no_pool_action(config)}


def _no_pool_action(config: GatewayConfig) -> dict:
    if len(config.schedulers) == 1:
        return {"route": pool_route_action(config.schedulers[0], config.max_fallbacks)}
    message = "no model pool was selected for this request (endpoint picker unavailable)"
    return {"direct_response": {"status": 503, "body": {"inline_string": message}}}


def decimal_at_most(limit: int) -> str:
    """An RE2 matching exactly the decimals 1..limit (no sign, no leading zero)."""
    digits = str(limit)
    width = len(digits)
    shorter = [f"[1-9][0-9]{{0,{width - 2}}}"] if width > 1 else []
    same = []  # same width: equal up to position i, smaller there, anything after
    for i, digit in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = f"[0-9]{{{width - i - 1}}}" if i < width - 1 else ""
            same.append(f"{digits[:i]}[{low}-{int(digit) - 1}]{rest}")
    return "|".join([*shorter, *same, digits])


def one_message_route(config: GatewayConfig, path: str) -> dict:
    """POST to an inference path with a declared body size within the limit: one message.

    The common request. Envoy skips the headers message (the picker gets the
    headers it reads as attributes with the body, see `ext_proc_filter`) and
    the buffer filter holds the headers until the picker answered
    (`hold_filter`). The action is `no_pool`'s: what happens when the picker
    assigns no pool. Everything else (other methods and paths, an empty or
    chunked body, a declared size over the limit) takes the two-message path,
    where the picker decides from the headers alone, before the body is read.
    """
    limit = config.bbr.max_request_body_bytes
    size = {"safe_regex": {"regex": decimal_at_most(limit)}}
    overrides = {"processing_mode": {**PROCESSING_MODE, "request_header_mode": "SKIP"}}
    return {
        "name": f"one_message{path.replace('/', '_')}",
        "match": {
            "path": path,
            "headers": [
                _exact(":method", "POST"),
                {"name": "content-length", "string_match": size},
            ],
        },
        **_no_pool_action(config),
        "typed_per_filter_config": {
            EXT_PROC: {"@type": EXT_PROC_ROUTE_TYPE, "overrides": overrides},
            # A per-route config turns the disabled filter on. (A bare FilterConfig
            # {disabled: false} passes `envoy --mode validate` but 1.40 rejects the
            # RDS file: "empty per filter configuration".)
            BUFFER: {"@type": BUFFER_ROUTE_TYPE, "buffer": {"max_request_bytes": limit}},
        },
    }


def pool_route(pool: SchedulerConfig, max_fallbacks: int) -> dict:
    """The pool the picker chose (its `envoy.lb` metadata); the picker's answer is also
    copied into the `x-gateway-*` request headers, for the pod and the access log."""
    chosen = {
        "filter": headers.LB_METADATA_NAMESPACE,
        "path": [{"key": headers.POOL}],
        "value": {"string_match": {"exact": pool.name}},
    }
    copies = [
        {
            "header": {
                "key": name,
                "value": f"%DYNAMIC_METADATA({headers.LB_METADATA_NAMESPACE}:{name})%",
            },
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
        }
        for name in headers.ROUTING_HEADERS
    ]
    return {
        "name": f"pool_{pool.name}",
        "match": {"prefix": "/", "dynamic_metadata": [chosen]},
        "route": pool_route_action(pool, max_fallbacks),
        "request_headers_to_add": copies,
    }


def fallback_routes(pool: SchedulerConfig, max_fallbacks: int) -> list[dict]:
    """The pool's names (model, adapters) as `fallback_filter` found them in the body."""
    return [
        {
            "name": f"fallback_{pool.name}_{i}",
            "match": {"prefix": "/", "headers": [_exact(headers.FALLBACK_MODEL, name)]},
            "route": pool_route_action(pool, max_fallbacks),
        }
        for i, name in enumerate((pool.model_name, *pool.lora_adapters))
    ]


def route_config(config: GatewayConfig) -> dict:
    """Health check, one route per pool on the picker's answer, the picker-less
    fallback routes (fail-open, several pools), the one-message routes, then the
    fallback."""
    routes = [health_route()]
    routes += [pool_route(pool, config.max_fallbacks) for pool in config.schedulers]
    if needs_fallback(config):
        for route in routes:  # the picker answered (or no body matters): no Lua
            route.setdefault("typed_per_filter_config", {}).update(_fallback_off())
        for pool in config.schedulers:
            routes += fallback_routes(pool, config.max_fallbacks)
    routes += [one_message_route(config, path) for path in API_PATHS]
    routes.append(no_pool_route(config))
    return {
        "name": "gateway",
        "virtual_hosts": [{"name": "gateway", "domains": ["*"], "routes": routes}],
    }
