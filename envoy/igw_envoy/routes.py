"""The listener's routes: health, one per pool on the picker's answer, the picker-less
fallbacks, the one-message routes, then what happens when no pool was chosen.

Pool routes match the picker's `envoy.lb` dynamic metadata, `override_host`
(in the pool cluster) reads the destination from it, and each pool route
copies it into the `x-gateway-*` request headers for the pod and the access
log. Routes also switch the HTTP filters of igw_envoy.http_filters on or off
per request (the buffer hold, ext_proc's processing mode, the Lua fallback).
"""

from __future__ import annotations

from bbr.request import API_PATHS
from contract import headers
from contract.config import GatewayConfig, SchedulerConfig, TlsConfig
from igw_envoy.clusters import PICKER_HTTP_CLUSTER
from igw_envoy.eds import cluster_name
from igw_envoy.http_filters import BUFFER, EXT_PROC, FALLBACK, PROCESSING_MODE, needs_fallback
from igw_envoy.jwt import HEALTH_PATH

EXT_PROC_ROUTE_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)
PREVIOUS_HOSTS_TYPE = (
    "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
)
BUFFER_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
LUA_ROUTE_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.LuaPerRoute"

# Retried on the picker's next address: failures before the pod produced anything
# (no connection, reset, refused stream) and gateway errors (502/503/504: a pod
# that is overloaded or whose engine is down). A plain 500 is not retried: it may
# be the request itself that breaks an engine, and it must not take down the next.
RETRY_ON = "connect-failure,reset,refused-stream,gateway-error"


def duration(seconds: float) -> str:
    """Seconds as an Envoy (protobuf JSON) duration: 120.0 -> "120s", 0.25 -> "0.25s"."""
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
    action: dict = {"cluster": cluster_name(pool.name), "timeout": duration(pool.route_timeout_s)}
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


def load_summary_routes(tls: TlsConfig) -> list[dict]:
    """The picker's load summary for the global router (picker.load_summary), on the
    same TLS listener as the traffic: one endpoint and one CA per region, and the RTT
    the global router measures on it is the traffic's. Served by the picker's HTTP
    server without ext_proc (nothing to route) and, like /healthz, without a token.
    With `spec.tls.clientCaFile` only to a client whose certificate was verified (the
    global router's); anyone else gets a 403, not the fleet's models and load."""
    match: dict = {"path": headers.LOAD_SUMMARY_PATH, "headers": [_exact(":method", "GET")]}
    no_ext_proc = {EXT_PROC: {"@type": EXT_PROC_ROUTE_TYPE, "disabled": True}}
    served = {
        "name": "load_summary",
        "match": match,
        "route": {"cluster": PICKER_HTTP_CLUSTER, "timeout": "2s"},
        "typed_per_filter_config": no_ext_proc,
    }
    if not tls.client_ca_file:
        return [served]
    served["match"] = {**match, "tls_context": {"validated": True}}
    refused = {
        "name": "load_summary_refused",
        "match": match,
        "direct_response": {"status": 403, "body": {
            "inline_string": "the load summary needs a verified client certificate\n"}},
        "typed_per_filter_config": no_ext_proc,
    }
    return [served, refused]


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
    return one_message_route_for(config.bbr.max_request_body_bytes, path, _no_pool_action(config))


def one_message_route_for(limit: int, path: str, action: dict) -> dict:
    """`one_message_route` with its action given (the global router's goes to regions)."""
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
        **action,
        "typed_per_filter_config": {
            EXT_PROC: {"@type": EXT_PROC_ROUTE_TYPE, "overrides": overrides},
            # A per-route config turns the disabled filter on. (A bare FilterConfig
            # {disabled: false} passes `envoy --mode validate` but 1.40 rejects the
            # RDS file: "empty per filter configuration".)
            BUFFER: {"@type": BUFFER_ROUTE_TYPE, "buffer": {"max_request_bytes": limit}},
        },
    }


def _from_metadata(name: str) -> dict:
    return {
        "header": {
            "key": name,
            "value": f"%DYNAMIC_METADATA({headers.LB_METADATA_NAMESPACE}:{name})%",
        },
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }


def rate_limit_headers() -> list[dict]:
    """A tenant's x-ratelimit-* figures on a served response, from the picker's metadata.

    The picker puts them into the same `envoy.lb` answer as the route, so they cost
    no extra message; a request without them (no limit on that dimension) has an
    empty value, and Envoy drops a custom header whose value is empty
    (`keep_empty_value` false).
    """
    return [_from_metadata(name) for name in headers.RATE_LIMIT_HEADERS]


def pool_route(pool: SchedulerConfig, max_fallbacks: int, tenants: bool = False) -> dict:
    """The pool the picker chose (its `envoy.lb` metadata); the picker's answer is also
    copied into the `x-gateway-*` request headers, for the pod and the access log, and
    (with tenants) a tenant's limits into the response headers."""
    chosen = {
        "filter": headers.LB_METADATA_NAMESPACE,
        "path": [{"key": headers.POOL}],
        "value": {"string_match": {"exact": pool.name}},
    }
    route = {
        "name": f"pool_{pool.name}",
        "match": {"prefix": "/", "dynamic_metadata": [chosen]},
        "route": pool_route_action(pool, max_fallbacks),
        "request_headers_to_add": [_from_metadata(name) for name in headers.ROUTING_HEADERS],
    }
    if tenants:
        route["response_headers_to_add"] = rate_limit_headers()
    return route


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


def _fallback_off() -> dict:
    return {FALLBACK: {"@type": LUA_ROUTE_TYPE, "disabled": True}}


def route_config(config: GatewayConfig) -> dict:
    """Health check, one route per pool on the picker's answer, the picker-less
    fallback routes (fail-open, several pools), the one-message routes, then the
    fallback."""
    routes = [health_route(), *load_summary_routes(config.tls)]
    tenants = config.tenants is not None
    routes += [pool_route(pool, config.max_fallbacks, tenants) for pool in config.schedulers]
    if needs_fallback(config):
        for route in routes:  # the picker answered (or no body matters): no Lua
            route.setdefault("typed_per_filter_config", {}).update(_fallback_off())
        for pool in config.schedulers:
            routes += fallback_routes(pool, config.max_fallbacks)
    routes += [one_message_route(config, path) for path in API_PATHS]
    routes.append(no_pool_route(config))
    host: dict = {"name": "gateway", "domains": ["*"], "routes": routes}
    if config.tenants is not None and config.tenants.keys_file is not None:
        # The client's API key is the gateway's business, not the model server's. The
        # router removes it as it forwards, after ext_proc has read it. (With JWT,
        # jwt_authn's `forward: false` already removed the token.)
        host["request_headers_to_remove"] = [headers.AUTHORIZATION]
    return {"name": "gateway", "virtual_hosts": [host]}
