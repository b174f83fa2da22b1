"""Pool membership for Envoy: one EDS file per pool cluster, replaced atomically.

Each pool cluster reads its members from `eds_dir/<cluster>.json` through
`path_config_source` with `watched_directory: eds_dir`; Envoy re-reads the
file when a file is renamed into the directory (within a second, DESIGN §8).
The renderer writes the first version from the config's static endpoints;
the picker calls `write_endpoints` whenever discovery changes a pool.

EDS endpoints must be IP addresses, so names are resolved at write time with
`contract.endpoints.resolve_endpoints`, the same mapping the picker uses for
the header it sets.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from contract.endpoints import format_endpoint, resolve_endpoints, split_endpoint
from igw_envoy.atomic import write_atomic

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def cluster_name(scheduler_name: str) -> str:
    """Envoy cluster of a pool; must equal `picker.datastore.Pool.cluster_name`."""
    return f"pool_{scheduler_name}"


def eds_path(eds_dir: Path, cluster: str) -> Path:
    """The watched EDS file of one cluster."""
    return Path(eds_dir) / f"{cluster}.json"


def load_assignment(cluster: str, addresses: Sequence[str]) -> dict:
    """The ClusterLoadAssignment for `addresses` (resolved to IPs)."""
    lb_endpoints = []
    for endpoint, configured in resolve_endpoints(addresses):
        host, port = split_endpoint(endpoint)
        lb_endpoint: dict = {
            "endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}
        }
        if configured != endpoint:
            lb_endpoint["endpoint"]["hostname"] = split_endpoint(configured)[0]
        lb_endpoints.append(lb_endpoint)
    return {
        "@type": CLA_TYPE,
        "cluster_name": cluster,
        "endpoints": [{"lb_endpoints": lb_endpoints}],
    }


def write_endpoints(eds_dir: Path, cluster_name: str, addresses: Sequence[str]) -> None:
    """Replace the pool's EDS file with exactly `addresses` (atomic, Envoy reloads it).

    An empty list is a valid state (every request to the pool then gets
    Envoy's 503 "no healthy upstream").
    """
    eds_dir = Path(eds_dir)
    eds_dir.mkdir(parents=True, exist_ok=True)
    document = {"resources": [load_assignment(cluster_name, addresses)]}
    data = json.dumps(document, indent=1, sort_keys=True).encode()
    write_atomic(eds_path(eds_dir, cluster_name), data)


def read_endpoints(eds_dir: Path, cluster_name: str) -> list[str]:
    """The `ip:port` members currently in a pool's EDS file (empty if there is none)."""
    try:
        document = json.loads(eds_path(eds_dir, cluster_name).read_text())
    except (OSError, ValueError):
        return []
    members = []
    for resource in document.get("resources", []):
        for locality in resource.get("endpoints", []):
            for lb_endpoint in locality.get("lb_endpoints", []):
                sock = lb_endpoint["endpoint"]["address"]["socket_address"]
                members.append(format_endpoint(sock["address"], sock["port_value"]))
    return members
