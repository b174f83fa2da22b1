"""`host:port` endpoints: how an address is parsed, spelt and resolved.

EDS endpoints must be IP addresses (an EDS cluster never resolves names), and
the `override_host` load balancer matches `x-gateway-destination-endpoint`
against those IPs. So the EDS writer and the picker's datastore must turn a
configured address into the same `ip:port` string: `resolve_endpoint` is that
one mapping, and the config validates addresses with the same `split_endpoint`.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Iterable

log = logging.getLogger(__name__)

_HOSTNAME_RE = re.compile(r"[A-Za-z0-9.-]+")


class EndpointError(ValueError):
    """An endpoint that is not `host:port`, or a name that does not resolve."""


def split_endpoint(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host without brackets, port)."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EndpointError(f"expected host:port, got {address!r}")
    if not 0 < int(port) < 65536:
        raise EndpointError(f"port must be 1-65535, got {int(port)}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def check_endpoint(address: str) -> str:
    """`address` unchanged if it is `host:port` with an IP literal or a DNS name as host.

    The host is kept as written (for Envoy and the resolver), so surrounding
    whitespace is refused rather than trimmed.
    """
    host, _ = split_endpoint(address)
    if address != address.strip():
        raise EndpointError(f"bad host in {address!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME_RE.fullmatch(host):
            raise EndpointError(f"bad host in {address!r}") from None
    return address


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


