"""Upstream clusters: one per pool (members from a watched EDS file) and the picker.

A pool cluster can only ever reach its own members: the picker's destination
(`ip:port[,ip:port...]`, the `x-gateway-destination-endpoint` key of its
`envoy.lb` dynamic metadata) is honoured by the `override_host` load-balancing
policy only for hosts in the cluster, and anything else falls back to
least-request over the same members (DESIGN §8). The policy reads no request
header, so nothing a client sends can choose the host.
"""

from __future__ import annotations

from pathlib import Path

from contract import headers
from igw_envoy.eds import eds_path

UPSTREAM_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
OVERRIDE_HOST_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
LEAST_REQUEST_TYPE = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
)
PICKER_CLUSTER = "picker"
PICKER_HTTP_CLUSTER = "picker_http"
# Many concurrent LLM requests are normal (long streams); Envoy's default of
# 1024 per cluster would turn a busy pool into 503s (overflow).
CIRCUIT_LIMIT = 100_000
POOL_CONNECT_TIMEOUT = "1s"
PICKER_CONNECT_TIMEOUT = "0.25s"
# vLLM and SGLang serve through uvicorn, which closes a keep-alive connection
# after 5 s idle; Envoy must drop it first, or it may reuse a connection the
# pod is closing at that moment (a reset, then a retry on another pod).
UPSTREAM_IDLE_TIMEOUT = "4s"


def thresholds(max_retries: int) -> dict:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": CIRCUIT_LIMIT,
                "max_pending_requests": CIRCUIT_LIMIT,
                "max_requests": CIRCUIT_LIMIT,
                "max_retries": max_retries,
            }
        ]
    }


def override_host_policy() -> dict:
    """override_host from the picker's `envoy.lb` metadata, else least-request."""
    sources = [
        {
            "metadata": {
                "key": headers.LB_METADATA_NAMESPACE,
                "path": [{"key": headers.DESTINATION_ENDPOINT}],
            }
        },
    ]
    fallback = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.least_request",
                    "typed_config": {"@type": LEAST_REQUEST_TYPE},
                }
            }
        ]
    }
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": OVERRIDE_HOST_TYPE,
                        "override_host_sources": sources,
                        "fallback_policy": fallback,
                    },
                }
            }
        ]
    }


def _http1_options() -> dict:
    """Model servers (vLLM, SGLang) speak HTTP/1.1; keep connections alive between requests."""
    return {
        UPSTREAM_HTTP_OPTIONS: {
            "@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
            "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
            "explicit_http_config": {"http_protocol_options": {}},
        }
    }


def _outlier_detection() -> dict:
    """Passive ejection of a pod that keeps failing; never more than half a pool.

    `override_host` ignores ejections (measured on 1.40: an ejected pod the picker
    named still got every request), so the picker reads them from
    the admin port and stops picking the pod (picker.envoy_admin). Three
    consecutive 5xx or gateway failures eject a pod for 5 s × the number of its
    ejections (at most 60 s); the 1 s interval is how precisely it comes back.
    """
    return {
        "consecutive_5xx": 3,
        "consecutive_gateway_failure": 3,
        "interval": "1s",
        "base_ejection_time": "5s",
        "max_ejection_time": "60s",
        "max_ejection_percent": 50,
    }


def pool_cluster(name: str, eds_dir: Path, buffer_limit: int, max_fallbacks: int) -> dict:
    """EDS cluster `name` whose members come from `eds_dir/<name>.json`."""
    eds_dir = Path(eds_dir).resolve()
    return {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {
            "service_name": name,
            "eds_config": {
                "path_config_source": {
                    "path": str(eds_path(eds_dir, name)),
                    "watched_directory": {"path": str(eds_dir)},
                },
                "resource_api_version": "V3",
            },
        },
        "connect_timeout": POOL_CONNECT_TIMEOUT,
        "per_connection_buffer_limit_bytes": buffer_limit,
        "load_balancing_policy": override_host_policy(),
        "circuit_breakers": thresholds(max_retries=max(1000, max_fallbacks * 1000)),
        "typed_extension_protocol_options": _http1_options(),
        "outlier_detection": _outlier_detection(),
    }


def picker_cluster(host: str, port: int) -> dict:
    """The ext_proc gRPC service: static, HTTP/2, a short connect timeout so a dead
    picker fails a request in milliseconds instead of hanging it."""
    return {
        "name": PICKER_CLUSTER,
        "type": "STATIC",
        "connect_timeout": PICKER_CONNECT_TIMEOUT,
        "circuit_breakers": thresholds(max_retries=3),
        "typed_extension_protocol_options": {
            UPSTREAM_HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "connection_keepalive": {"interval": "30s", "timeout": "5s"}
                    }
                },
            }
        },
        "load_assignment": static_assignment(PICKER_CLUSTER, [(host, port)]),
    }


def picker_http_cluster(host: str, port: int) -> dict:
    """The picker's plain HTTP server (metrics port), for the load summary route:
    static, HTTP/1.1, the picker's short connect timeout."""
    return {
        "name": PICKER_HTTP_CLUSTER,
        "type": "STATIC",
        "connect_timeout": PICKER_CONNECT_TIMEOUT,
        "load_assignment": static_assignment(PICKER_HTTP_CLUSTER, [(host, port)]),
    }


def static_assignment(
    cluster: str, hosts: list[tuple[str, int]], metadata: list[dict] | None = None
) -> dict:
    """A STATIC cluster's `load_assignment`: one locality, these hosts in order, each with
    its endpoint metadata when given."""
    endpoints = []
    for i, (host, port) in enumerate(hosts):
        endpoint: dict = {
            "endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}
        }
        if metadata is not None:
            endpoint["metadata"] = metadata[i]
        endpoints.append(endpoint)
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": endpoints}]}
