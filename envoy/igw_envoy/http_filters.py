"""The listener's HTTP filter chain, in the order the security argument needs.

Client copies of the routing headers are removed first (`early_strip` before
the first route match, `strip_filter` as the first filter), then JWT (when
configured) rejects unauthenticated requests, then ext_proc asks the picker,
then the buffer filter holds one-message requests until the picker answered,
then (fail-open with several pools) Lua reads the model from the body, then (with
tenants) Lua counts each response's output tokens (igw_envoy.usage), then the
router connects to the pool member the picker named.

The picker answers in `envoy.lb` dynamic metadata, never in request headers
(see `ext_proc_filter`); a client cannot set dynamic metadata at all. Which
route turns which filter on or off is igw_envoy.routes.
"""

from __future__ import annotations

from pathlib import Path

from contract import headers
from contract.config import GatewayConfig
from igw_envoy.clusters import PICKER_CLUSTER
from igw_envoy.jwt import jwt_filter
from igw_envoy.usage import USAGE_LUA, measures_usage

EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HEADER_MUTATION_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)
EARLY_MUTATION_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation"
)
ROUTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
BUFFER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
EXT_PROC = "envoy.filters.http.ext_proc"
BUFFER = "envoy.filters.http.buffer"
FALLBACK = "envoy.filters.http.lua"
USAGE = "igw.usage"
MESSAGE_TIMEOUT = "2s"
MAX_MESSAGE_TIMEOUT = "60s"


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
    return ext_proc_filter_for(config.failure_mode == "open", request_attributes(config))


def ext_proc_filter_for(fail_open: bool, attributes: list[str]) -> dict:
    """`ext_proc_filter` from its two variable parts (the global router's is this too)."""
    return {
        "name": EXT_PROC,
        "typed_config": {
            "@type": EXT_PROC_TYPE,
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
            "failure_mode_allow": fail_open,
            # A dead picker with fail-closed: a fast, retryable 503 (not 500).
            "status_on_error": {"code": "ServiceUnavailable"},
            "processing_mode": PROCESSING_MODE,
            "request_attributes": attributes,
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


def request_attributes(config: GatewayConfig) -> list[str]:
    """What the picker reads; the tenant's credentials only when spec.tenants is set
    (without tenants, not one more byte per request)."""
    names = list(headers.REQUEST_ATTRIBUTES)
    if config.tenants is not None:
        names += headers.TENANT_ATTRIBUTES
    return names


def hold_filter(config: GatewayConfig) -> dict:
    """A buffer filter after ext_proc, off unless a route turns it on.

    With the headers phase skipped, ext_proc lets the headers through at once
    and the router would pick the route and the host before the picker saw the
    body (measured: every request got the fallback route). On a
    `one_message_route` this filter holds the headers until the whole body has
    passed ext_proc, so the router matches after the picker's answer.
    """
    return hold_filter_for(config.bbr.max_request_body_bytes)


def hold_filter_for(body_limit: int) -> dict:
    return {
        "name": BUFFER,
        "disabled": True,
        "typed_config": {"@type": BUFFER_TYPE, "max_request_bytes": body_limit},
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


def usage_filter() -> dict:
    """The response-side output token counter (igw_envoy.usage); last before the
    router, so it is the first filter a response passes through."""
    return {
        "name": USAGE,
        "typed_config": {"@type": LUA_TYPE, "default_source_code": {"inline_string": USAGE_LUA}},
    }


def router_filter() -> dict:
    return {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}


def http_filters(config: GatewayConfig, jwt_base_dir: Path | None) -> list[dict]:
    filters = [strip_filter()]
    if config.jwt is not None:
        claim = config.tenants.jwt_claim if config.tenants is not None else None
        filters.append(jwt_filter(config.jwt, jwt_base_dir, claim))
    filters += [ext_proc_filter(config), hold_filter(config)]
    if needs_fallback(config):
        filters.append(fallback_filter())
    if measures_usage(config):
        filters.append(usage_filter())
    filters.append(router_filter())
    return filters
