"""Pool membership for Envoy: one EDS file per pool cluster, replaced atomically.

Each pool cluster reads its members from `eds_dir/<cluster>.json` through
`path_config_source` with `watched_directory: eds_dir`; Envoy re-reads the
file when a file is renamed into the directory (within a second, DESIGN §8).
The renderer writes the first version from the config's static endpoints;
the picker calls `write_endpoints` whenever discovery changes a pool.

EDS endpoints must be IP addresses (an EDS cluster never resolves names), and
the `override_host` load balancer matches `x-gateway-destination-endpoint`
against those IPs. So DNS names are resolved here, at write time, with
`socket.getaddrinfo`, and the picker must put the same resolved form in the
header: `resolve_endpoint` is the one mapping both sides use.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path

from igw_envoy.atomic import write_atomic

log = logging.getLogger(__name__)

CLA_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


class EndpointError(ValueError):
    """An endpoint that is not `host:port`, or a name that does not resolve."""


def cluster_name(scheduler_name: str) -> str:
    """Envoy cluster of a pool; must equal `picker.datastore.Pool.cluster_name`."""
    return f"pool_{scheduler_name}"


def eds_path(eds_dir: Path, cluster: str) -> Path:
    """The watched EDS file of one cluster."""
    return Path(eds_dir) / f"{cluster}.json"


def split_endpoint(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host without brackets, port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"expected host:port, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_endpoint(ip: str, port: int) -> str:
    """The `ip:port` / `[v6]:port` spelling that override_host matches on."""
    parsed = ipaddress.ip_address(ip)
    return f"[{parsed.compressed}]:{port}" if parsed.version == 6 else f"{parsed}:{port}"


def resolve_endpoint(address: str) -> list[str]:
    """Canonical `ip:port` strings for one configured address.

    An IP literal maps to itself (normalised). A name maps to every address of
    the first family getaddrinfo returns: a headless-service name gives all
    its pods, and `localhost` does not become two members (127.0.0.1 and ::1)
    of which one may have no listener.
    """
    host, port = split_endpoint(address)
    try:
        return [format_endpoint(host, port)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise EndpointError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family = infos[0][0]
    ips = [str(info[4][0]).split("%", 1)[0] for info in infos if info[0] == family]
    return [format_endpoint(ip, port) for ip in dict.fromkeys(ips)]


def resolve_endpoints(addresses: Iterable[str]) -> list[tuple[str, str]]:
    """(`ip:port`, configured address) pairs, deduplicated; unresolvable names are skipped.

    Skipping (with a warning) rather than failing keeps a pool's other members
    serving when one name is briefly unresolvable; discovery will write the
    file again on its next change.
    """
    out: dict[str, str] = {}
    for address in addresses:
        try:
            resolved = resolve_endpoint(address)
        except EndpointError as exc:
            log.warning("EDS: skipping endpoint %s: %s", address, exc)
            continue
        for endpoint in resolved:
            out.setdefault(endpoint, address)
    return list(out.items())


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
