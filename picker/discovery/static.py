"""Static endpoints whose hosts are names: re-resolved so a moved pod is followed.

Configured `host:port` endpoints are resolved to `ip:port` when the config is
applied (the datastore). A name can later point elsewhere (a compose service
restarted with a new IP, a DNS record changed), so every `interval_s` the
names are resolved again, off the event loop, and a change updates the pool
and Envoy's EDS file. IP literals never change and cost nothing here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable

from contract.endpoints import resolve_endpoints, split_endpoint
from picker.datastore import Datastore

log = logging.getLogger("picker.discovery.static")

RESOLVE_INTERVAL_S = 5.0


def has_names(endpoints: tuple[str, ...]) -> bool:
    """True when any endpoint's host is a name rather than an IP literal."""
    for endpoint in endpoints:
        host, _ = split_endpoint(endpoint)
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return True
    return False


class StaticResolver:
    """Re-resolves named static endpoints; `on_change(pool_name)` after an update."""

    def __init__(
        self,
        datastore: Datastore,
        on_change: Callable[[str], None],
        interval_s: float = RESOLVE_INTERVAL_S,
    ) -> None:
        self.datastore = datastore
        self.on_change = on_change
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="igw-static-resolver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.resolve_once()

    async def resolve_once(self) -> None:
        for pool in list(self.datastore.pools.values()):
            endpoints = pool.config.endpoints
            if not endpoints or not has_names(endpoints):
                continue
            resolved = await asyncio.to_thread(resolve_endpoints, endpoints)
            if not resolved:
                continue  # resolution failing entirely: keep the last known members
            if pool.set_members([ip for ip, _ in resolved], dict(resolved)):
                log.info("static endpoints of pool %s re-resolved: %s", pool.name,
                         ",".join(pool.members()))
                self.on_change(pool.name)
