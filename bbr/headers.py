"""Header names shared by the picker and the rendered Envoy config.

The routing headers are set only by the picker; Envoy strips any copy a
client sends before the picker runs, so a client can never choose a host.
"""

DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
MODEL_NAME = "x-gateway-model-name"
BASE_MODEL_NAME = "x-gateway-base-model-name"
POOL = "x-gateway-pool"

ROUTING_HEADERS = (DESTINATION_ENDPOINT, MODEL_NAME, BASE_MODEL_NAME, POOL)

# Client-settable request hints (not routing): honoured, never stripped.
PRIORITY = "x-gateway-priority"
CRITICALITY = "x-gateway-criticality"

# Dynamic metadata namespace Envoy's override_host policy can also read.
LB_METADATA_NAMESPACE = "envoy.lb"
