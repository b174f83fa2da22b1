"""Which pods are pool members: pure functions over the Pod objects a watch delivers.

Kept apart from the watch loop so the rule ("Ready, not terminating, has an
IP") is one readable function, tested without any API server.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SelectorKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PodView:
    """The little of a Pod that membership depends on."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool

    @property
    def serving(self) -> bool:
        """A member: Ready=True, no deletionTimestamp (draining), and an IP to reach."""
        return self.ready and not self.terminating and bool(self.ip)


def selector_key(labels: Mapping[str, str]) -> SelectorKey:
    """A hashable, order-free identity for a matchLabels map (one watch per distinct key)."""
    return tuple(sorted(labels.items()))


def pod_view(pod: Any) -> PodView:
    """Read a lightkube `Pod` (or anything shaped like one) into a `PodView`.

    Ready is the pod's `Ready` condition, which already folds in container
    readiness probes and readiness gates; a deletionTimestamp means the pod
    is shutting down even while still Ready, so it takes no new requests.
    """
    meta = pod.metadata
    status = pod.status
    ready = False
    ip = None
    if status is not None:
        ip = status.podIP or None
        for condition in status.conditions or ():
            if condition.type == "Ready":
                ready = condition.status == "True"
                break
    return PodView(
        name=meta.name or "",
        ip=ip,
        ready=ready,
        terminating=meta.deletionTimestamp is not None,
    )


def endpoint(ip: str, port: int) -> str:
    """`ip:port`, with brackets for IPv6, the form Envoy's EDS writer accepts."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def members(pods: Iterable[PodView], port: int) -> list[str]:
    """Sorted endpoints of the serving pods (sorted: stable EDS files, fewer rewrites)."""
    out = set()
    for pod in pods:
        if pod.serving and pod.ip is not None:
            try:
                out.add(endpoint(pod.ip, port))
            except ValueError:
                continue
    return sorted(out)
