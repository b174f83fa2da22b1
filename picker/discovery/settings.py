"""When Kubernetes discovery runs, and what it watches: read from the environment.

Environment, not flags, because `igw serve` starts the picker as a child
process and passes its own argv; variables set on the container reach the
picker unchanged, so the Helm chart configures discovery without `igw`
knowing about it.

- `IGW_DISCOVERY`: `auto` (default: on when `KUBERNETES_SERVICE_HOST` is set,
  i.e. in a pod), `kubernetes` / `on` (also outside a cluster, with
  `$KUBECONFIG` or `~/.kube/config`), `off`.
- `IGW_POD_NAMESPACE`: namespace whose pods are watched; default the
  client's namespace (in a pod: its own, from the service account).
- `IGW_CONFIG_RESOURCE`: `[NAMESPACE/]NAME` of an `InferenceGatewayConfig`
  to follow; unset: the config file only.
- `IGW_CONFIG_STATUS`: write `status.conditions` on that resource (`true`).
- `IGW_DISCOVERY_RESYNC`: seconds before a watch is replaced by a fresh list
  (`300`).
- `IGW_DISCOVERY_SYNC_TIMEOUT`: seconds `start()` waits for the first lists
  (`10`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MODES = ("auto", "kubernetes", "on", "off")


class SettingsError(ValueError):
    """A discovery environment variable with a value that cannot be used."""


@dataclass(frozen=True)
class ConfigResource:
    """Which `InferenceGatewayConfig` object to follow; namespace None = the client's."""

    name: str
    namespace: str | None = None

    @classmethod
    def parse(cls, text: str) -> ConfigResource:
        namespace, sep, name = text.strip().rpartition("/")
        if not _DNS_SUBDOMAIN.match(name) or (sep and not _DNS_LABEL.match(namespace)):
            raise SettingsError(f"IGW_CONFIG_RESOURCE: expected [NAMESPACE/]NAME, got {text!r}")
        return cls(name=name, namespace=namespace or None)


@dataclass(frozen=True)
class DiscoverySettings:
    """What the Kubernetes discovery does; every number bounded."""

    enabled: bool
    pod_namespace: str | None = None
    config_resource: ConfigResource | None = None
    write_status: bool = True
    resync_s: float = 300.0
    initial_sync_timeout_s: float = 10.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DiscoverySettings:
        env = os.environ if env is None else env
        mode = env.get("IGW_DISCOVERY", "auto").strip().lower() or "auto"
        if mode not in MODES:
            raise SettingsError(f"IGW_DISCOVERY: must be one of {', '.join(MODES)}; got {mode!r}")
        in_cluster = bool(env.get("KUBERNETES_SERVICE_HOST"))
        enabled = mode in ("kubernetes", "on") or (mode == "auto" and in_cluster)
        namespace = env.get("IGW_POD_NAMESPACE", "").strip() or None
        if namespace is not None and not _DNS_LABEL.match(namespace):
            raise SettingsError(f"IGW_POD_NAMESPACE: not a namespace name: {namespace!r}")
        resource_text = env.get("IGW_CONFIG_RESOURCE", "").strip()
        resource = ConfigResource.parse(resource_text) if resource_text else None
        return cls(
            enabled=enabled,
            pod_namespace=namespace,
            config_resource=resource,
            write_status=_flag(env.get("IGW_CONFIG_STATUS", "true"), "IGW_CONFIG_STATUS"),
            resync_s=_seconds(env.get("IGW_DISCOVERY_RESYNC"), "IGW_DISCOVERY_RESYNC", 300.0),
            initial_sync_timeout_s=_seconds(
                env.get("IGW_DISCOVERY_SYNC_TIMEOUT"), "IGW_DISCOVERY_SYNC_TIMEOUT", 10.0
            ),
        )


def _flag(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}: expected true or false, got {text!r}")


def _seconds(text: str | None, name: str, default: float) -> float:
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"{name}: expected seconds, got {text!r}") from None
    if not 0.1 <= value <= 86400:
        raise SettingsError(f"{name}: must be between 0.1 and 86400 seconds, got {text!r}")
    return value
