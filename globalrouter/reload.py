"""Reloading the GlobalRouterConfig without a restart: drains, prices, policies, limits.

The front door's Envoy is static (igw_envoy.global_front renders one bootstrap), so
what it is made of changes only with a restart of `igw global serve`: the regions'
names, endpoints and TLS, the listener, ports, retries, auth and tenancy mode; and so
do what the router sets up once (the coordination link, affinity's bounds, the
config's name, which keys the limits' Redis entries). A file that changes any of it is
refused, said so in the log and the metrics, and the running config stays.

Everything else is the router's alone and is applied within a poll of the file (1 s,
or at once on SIGHUP): a region drained or back, costs and tags (residency), model
policies and SLOs, polling, spill-over saturation, the tenant list and limits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from contract.config import ConfigError
from contract.global_config import GlobalRouterConfig, load_global_config
from picker.reload import file_signature, listener_changes, watch_file

log = logging.getLogger("globalrouter.reload")


def restart_only_changes(old: GlobalRouterConfig, new: GlobalRouterConfig) -> list[str]:
    """The config fields that differ and cannot change without a restart."""
    checks = {
        **listener_changes(old, new),
        "spec.regions (names, endpoints, caFile, serverName)": _wiring(old) != _wiring(new),
        "spec.ports": (old.picker_port, old.metrics_port, old.envoy_admin_port)
        != (new.picker_port, new.metrics_port, new.envoy_admin_port),
        "spec.maxRetries": old.max_retries != new.max_retries,
        "spec.coordination": old.coordination != new.coordination,
        "spec.affinity": old.affinity != new.affinity,
        "spec.regionClientTls": old.region_client_tls != new.region_client_tls,
        "metadata": (old.name, old.namespace) != (new.name, new.namespace),
    }
    return [name for name, changed in checks.items() if changed]


def _wiring(config: GlobalRouterConfig) -> tuple[tuple[str, str, str | None, str], ...]:
    """What the regions cluster of Envoy's bootstrap is rendered from, region by region."""
    return tuple((r.name, r.endpoint, r.ca_file, r.server_name) for r in config.regions)


class GlobalConfigReloader:
    """Holds the running config; adopts a changed file when only reloadable parts moved."""

    def __init__(self, config: GlobalRouterConfig, path: Path,
                 adopt: Callable[[GlobalRouterConfig], None]) -> None:
        self.config = config
        self.path = path
        self._adopt = adopt
        self._signature = file_signature(path)
        self.results: Counter[str] = Counter()  # applied / refused → reloads
        self.last = ""  # what the last reload did, for /regions

    async def watch(self, stopping: asyncio.Event) -> None:
        """Reload whenever the file changes (a ConfigMap swaps it), until stopped."""
        await watch_file(self.path, self._signature, stopping, self.reload)

    def reload(self) -> bool:
        """Apply the file if it is valid and reloadable; keep the running config otherwise."""
        try:
            config = load_global_config(self.path)
        except ConfigError as exc:
            return self._refuse(str(exc))
        fields = restart_only_changes(self.config, config)
        if fields:
            return self._refuse(f"{', '.join(fields)}: cannot change while the router runs "
                                "(restart `igw global serve` to apply)")
        self.config = config
        self._adopt(config)
        self.results["applied"] += 1
        self.last = "applied"
        log.info("config applied: drained=%s",
                 ",".join(r.name for r in config.regions if r.drain) or "none")
        return True

    def _refuse(self, message: str) -> bool:
        log.error("config reload refused, keeping the running config: %s", message)
        self.results["refused"] += 1
        self.last = f"refused: {message}"
        return False
