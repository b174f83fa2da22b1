"""Header names shared by the picker and the rendered Envoy config.

The routing headers are set only from the picker's answer; Envoy strips any
copy a client sends before the picker runs, so a client can never choose a host.
"""

DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
MODEL_NAME = "x-gateway-model-name"
BASE_MODEL_NAME = "x-gateway-base-model-name"
POOL = "x-gateway-pool"

ROUTING_HEADERS = (DESTINATION_ENDPOINT, MODEL_NAME, BASE_MODEL_NAME, POOL)
# Set by Envoy itself (fail-open with several pools, the picker unreachable): the
# body's model, so a route can still find the pool. Stripped like the above.
FALLBACK_MODEL = "x-gateway-fallback-model"
# Set by Envoy's jwt_authn from the verified token's tenant claim (spec.tenants.jwtClaim).
# A client's copy is stripped before jwt_authn runs, so only a verified claim reaches
# the picker.
TENANT = "x-gateway-tenant"
STRIPPED_HEADERS = (*ROUTING_HEADERS, FALLBACK_MODEL, TENANT)
AUTHORIZATION = "authorization"

# Client-settable request hints (not routing): honoured, never stripped.
PRIORITY = "x-gateway-priority"
CRITICALITY = "x-gateway-criticality"

# Dynamic metadata namespace the picker answers in (keys: the routing header names);
# Envoy's routes and override_host policy read it.
LB_METADATA_NAMESPACE = "envoy.lb"
# Where Envoy's response-side Lua filter leaves a response's measured output tokens
# (a number) and whether they came from the response's own `usage` (a bool, else
# counted from stream events); Envoy's access log carries both to the picker.
USAGE_METADATA_NAMESPACE = "igw.usage"
OUTPUT_TOKENS_KEY = "output_tokens"
USAGE_EXACT_KEY = "exact"

# What the picker reads from the request headers, as Envoy attribute expressions
# (ext_proc `request_attributes`), each with the picker's field it fills. When a
# route skips the headers message, these arrive with the body message instead,
# keyed by the expression; an absent header is an absent key.
REQUEST_ATTRIBUTES = {
    "request.url_path": "path",  # the path without its query string
    "request.id": "request_id",  # x-request-id
    "request.headers['content-type']": "content_type",
    "request.headers['content-encoding']": "content_encoding",
    f"request.headers['{PRIORITY}']": "priority",
    f"request.headers['{CRITICALITY}']": "criticality",
}

# Read only when spec.tenants is set (the listener asks for them then): the API key
# and the JWT claim header. Same rules as REQUEST_ATTRIBUTES.
TENANT_ATTRIBUTES = {
    f"request.headers['{AUTHORIZATION}']": "authorization",
    f"request.headers['{TENANT}']": "tenant_claim",
}
# What the picker answers about a tenant's limits in `envoy.lb` dynamic metadata; the
# pool routes copy each into the response header of the same name (OpenAI's names).
RATE_LIMIT_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)

# Tier 2, the global router (docs/global.md). Every answer a region served names it
# (response header); a client may narrow the regions its request may go to with an
# allow-list (`a,b`, request hint: it never widens the choice, never stripped).
REGION = "x-gateway-region"
REGIONS = "x-gateway-regions"
# A conversation's id (our name, the one coding agents and LLM gateways commonly send):
# the global router keeps a session in the region that served it (globalrouter.affinity).
SESSION = "x-session-id"
# The global router reads the allow-list and the session like the other request hints.
GLOBAL_ATTRIBUTES = {
    f"request.headers['{REGIONS}']": "regions",
    f"request.headers['{SESSION}']": "session",
}
# Where a Tier-1 gateway serves its load summary (picker.load_summary), on its listener.
LOAD_SUMMARY_PATH = "/igw/v1/load-summary"
