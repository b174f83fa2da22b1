"""Kubernetes discovery: pool members from pod watches, config from a custom resource.

Off unless the picker runs in a pod (`KUBERNETES_SERVICE_HOST`) or
`IGW_DISCOVERY=kubernetes` says so (settings: `picker.discovery.settings`).
Outside Kubernetes the static `endpoints:` of each scheduler are the members
and nothing here is imported, so lightkube is needed only where it is used.

    picker.discovery.settings         environment → DiscoverySettings
    picker.discovery.pods             Pod → PodView → member endpoints (pure)
    picker.discovery.config_resource  custom resource → GatewayConfig, outcome → status
    picker.discovery.kubernetes       the list+watch sessions (lightkube, asyncio)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from picker.discovery.settings import DiscoverySettings, SettingsError

if TYPE_CHECKING:
    from picker.discovery.kubernetes import DiscoveryTarget, KubernetesDiscovery

__all__ = ["DiscoverySettings", "SettingsError", "start_discovery"]


async def start_discovery(
    target: DiscoveryTarget, env: Mapping[str, str] | None = None
) -> KubernetesDiscovery | None:
    """Start watching when the environment asks for it; None when discovery is off.

    A bad setting or an unusable kubeconfig raises: a gateway told to discover
    pods that cannot is a deployment error to see at once (the pod restarts
    and says why), not a gateway that silently serves empty pools.
    """
    settings = DiscoverySettings.from_env(env)
    if not settings.enabled:
        return None
    from picker.discovery.kubernetes import KubernetesDiscovery

    discovery = KubernetesDiscovery(target, settings)
    await discovery.start()
    return discovery
