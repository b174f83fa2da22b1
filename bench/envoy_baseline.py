"""A plain Envoy in front of the pods: the baseline the gateway replaces.

One HTTPS listener per model pool (a Kubernetes Service per model, in effect), each
routing everything to a STATIC cluster of that pool's pods with Envoy's own
`ROUND_ROBIN` or `LEAST_REQUEST` load balancing. Same Envoy binary, same certificate,
same TLS parameters, same HTTP/1.1 upstream keep-alive settings, same route and idle
timeouts and circuit-breaker ceilings as the gateway's Envoy; only the ext_proc call and
the override-host load balancing are absent.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from igw_envoy.clusters import CIRCUIT_LIMIT, UPSTREAM_HTTP_OPTIONS
from igw_envoy.downstream_tls import downstream_tls_socket
from igw_envoy.http_filters import ROUTER_TYPE
from igw_envoy.listener import HCM_TYPE

POLICIES = ("ROUND_ROBIN", "LEAST_REQUEST")


def listener_tls(cert: Path, key: Path) -> dict:
    """The gateway's listener TLS policy over certificate files (no SDS)."""
    return downstream_tls_socket(
        {
            "tls_certificates": [
                {
                    "certificate_chain": {"filename": str(cert)},
                    "private_key": {"filename": str(key)},
                }
            ]
        }
    )


def _listener(name: str, port: int, cluster: str, tls: tuple[Path, Path] | None) -> dict:
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": name,
        "codec_type": "AUTO",
        "stream_idle_timeout": "300s",
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "http_filters": [
            {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}
        ],
        "route_config": {
            "name": name,
            "virtual_hosts": [
                {
                    "name": name,
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {"cluster": cluster, "timeout": "300s"},
                        }
                    ],
                }
            ],
        },
    }
    chain: dict = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if tls is not None:
        chain["transport_socket"] = listener_tls(*tls)
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [chain],
    }


def _cluster(name: str, policy: str, endpoints: list[str]) -> dict:
    lb_endpoints = []
    for address in endpoints:
        host, _, port = address.rpartition(":")
        lb_endpoints.append(
            {
                "endpoint": {
                    "address": {"socket_address": {"address": host, "port_value": int(port)}}
                }
            }
        )
    return {
        "name": name,
        "type": "STATIC",
        "lb_policy": policy,
        "connect_timeout": "1s",
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": CIRCUIT_LIMIT,
                    "max_pending_requests": CIRCUIT_LIMIT,
                    "max_requests": CIRCUIT_LIMIT,
                    "max_retries": 1000,
                }
            ]
        },
        "typed_extension_protocol_options": {
            UPSTREAM_HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{UPSTREAM_HTTP_OPTIONS}",
                "common_http_protocol_options": {"idle_timeout": "4s"},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": lb_endpoints}]},
    }


def bootstrap(
    policy: str,
    pools: dict[str, tuple[int, list[str]]],
    admin_port: int,
    tls: tuple[Path, Path] | None,
) -> dict:
    """Bootstrap: for each pool name, (listen port, pod addresses)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    listeners, clusters = [], []
    for i, (port, endpoints) in enumerate(pools.values()):
        cluster = f"pool_{i}"
        listeners.append(_listener(f"listener_{i}", port, cluster, tls))
        clusters.append(_cluster(cluster, policy, endpoints))
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
