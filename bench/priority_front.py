"""A plain Envoy priority-failover front over the regions: what users build today.

The baseline bench.global_cost compares the global router against. No router, no
load summary: one cluster whose members are the regions' Tier-1 listeners, each in
its own priority (`LocalityLbEndpoints.priority`, 0 first). Envoy sends everything
to the highest healthy priority and only moves on when that region is unhealthy
(active health check, outlier ejection) or, per request, on a retry: connect
failure, reset, refused stream or a 5xx moves the retry to another priority
(`envoy.retry_priorities.previous_priorities`) and another host (`previous_hosts`).

The order is the one a user optimising for latency picks with these regions: the
fastest (and nearest) first, us-east-1, then us-west-2, then eu-west-1. Cheapest
first would put everything on the slowest GPUs and miss the SLO whenever its
prompts are long; a priority list cannot say "cheap while it is fast enough".

Built from the global front's pieces (igw_envoy.global_front): the same TLS per
region (its CA and server name, by `transport_socket_matches`), the same active
health check and outlier detection, the same listener; every answer names the
region that served it (`x-gateway-region`, from the endpoint's metadata).
"""

from __future__ import annotations

from pathlib import Path

from contract.endpoints import split_endpoint
from contract.global_config import GlobalRouterConfig, region_address
from igw_envoy import replies
from igw_envoy.global_front import (
    REGION_METADATA,
    REGIONS_CLUSTER,
    ROUTE_TIMEOUT_S,
    TRANSPORT_MATCH,
    regions_cluster,
    served_by,
)
from igw_envoy.http_filters import router_filter
from igw_envoy.listener import connection_manager_base, https_listener
from igw_envoy.render import default_paths, ensure_certificate, overload_manager
from igw_envoy.routes import PREVIOUS_HOSTS_TYPE, health_route
from igw_envoy.sds import write_secret

# The region order of the priorities, highest priority first (see the module docstring).
PRIORITY_ORDER = ("us-east-1", "us-west-2", "eu-west-1")
RETRY_ON = "connect-failure,reset,refused-stream,5xx"
PREVIOUS_PRIORITIES_TYPE = ("type.googleapis.com/envoy.extensions.retry.priority."
                            "previous_priorities.v3.PreviousPrioritiesConfig")


def priority_assignment(config: GlobalRouterConfig, order: tuple[str, ...]) -> dict:
    """One locality per region, its priority its place in `order` (regions not named
    come after, in config order)."""
    ranked = sorted(config.regions, key=lambda r: order.index(r.name) if r.name in order
                    else len(order))
    localities = []
    for priority, region in enumerate(ranked):
        host, port = split_endpoint(region_address(region))
        localities.append({
            "priority": priority,
            "lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": host,
                                                            "port_value": port}}},
                "metadata": {"filter_metadata": {
                    REGION_METADATA: {"region": region.name},
                    TRANSPORT_MATCH: {"region": region.name},
                }},
            }],
        })
    return {"cluster_name": REGIONS_CLUSTER, "endpoints": localities}


def priority_cluster(config: GlobalRouterConfig, order: tuple[str, ...]) -> dict:
    """The global front's regions cluster, balanced by priority instead of by the router."""
    cluster = regions_cluster(config)
    del cluster["load_balancing_policy"]  # plain round robin within a priority
    cluster["load_assignment"] = priority_assignment(config, order)
    return cluster


def retry_policy(retries: int) -> dict:
    """Retry on another priority (and another host) when a region fails before answering."""
    return {
        "retry_on": RETRY_ON,
        "num_retries": retries,
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {"@type": PREVIOUS_PRIORITIES_TYPE, "update_frequency": 1},
        },
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": PREVIOUS_HOSTS_TYPE},
        }],
        "host_selection_retry_max_attempts": 3,
    }


def render_priority_bootstrap(config: GlobalRouterConfig, state_dir: Path, port: int,
                              admin_port: int, order: tuple[str, ...] = PRIORITY_ORDER
                              ) -> dict:
    """The whole bootstrap: the global front's TLS listener (its certificate, so a client
    trusts both fronts alike) without ext_proc, routing to the priority cluster."""
    limit = config.bbr.max_request_body_bytes
    paths = default_paths(config, state_dir)
    paths.state_dir.mkdir(parents=True, exist_ok=True)
    tls_files = ensure_certificate(config, paths)
    write_secret(paths.sds_dir, tls_files.cert, tls_files.key)
    route = {"cluster": REGIONS_CLUSTER, "timeout": f"{ROUTE_TIMEOUT_S:g}s",
             "retry_policy": retry_policy(config.max_retries)}
    routes = [health_route(),
              {"name": "regions", "match": {"prefix": "/"}, "route": route,
               "response_headers_to_add": served_by()}]
    hcm = {
        **connection_manager_base(limit, ROUTE_TIMEOUT_S),
        "http_filters": [router_filter()],
        "route_config": {"name": "priority",
                         "virtual_hosts": [{"name": "priority", "domains": ["*"],
                                            "routes": routes}]},
        "local_reply_config": replies.local_reply_config(limit),
    }
    return {
        "node": {"id": "igw-bench-priority", "cluster": "igw-bench-priority"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [https_listener("127.0.0.1", port, limit, hcm, paths.sds_dir)],
            "clusters": [priority_cluster(config, order)],
        },
        "overload_manager": overload_manager(),
    }
