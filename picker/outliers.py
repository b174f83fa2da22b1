"""Passive health: Envoy's outlier ejections, followed into the pods' ready flags.

`override_host` sends a request to the pod the picker names even when Envoy's
outlier detection has ejected it, so the picker itself must stop naming an
ejected pod: it polls Envoy's `/clusters` and treats an ejected pod as not
ready until Envoy releases it.
"""

from __future__ import annotations

import asyncio
import logging

from picker.datastore import Datastore
from picker.envoy_admin import EnvoyAdmin, ejected

log = logging.getLogger("picker.outliers")

OUTLIER_POLL_S = 0.25
OUTLIER_IDLE_POLL_S = 2.0  # while Envoy's admin port does not answer


class OutlierFollower:
    """Keeps the pods Envoy has ejected not ready, and makes them ready once released."""

    def __init__(self, datastore: Datastore, envoy: EnvoyAdmin) -> None:
        self._datastore = datastore
        self._envoy = envoy
        self._ejected: set[tuple[str, str]] = set()  # (pool, address) Envoy has ejected

    @property
    def ejected_count(self) -> int:
        return len(self._ejected)

    async def watch(self, stopping: asyncio.Event) -> None:
        """Poll Envoy until the picker stops; slower while Envoy does not answer."""
        while not stopping.is_set():
            hosts = await self._envoy.hosts()
            if hosts is not None:
                self.apply(hosts)
            await asyncio.sleep(OUTLIER_POLL_S if hosts is not None else OUTLIER_IDLE_POLL_S)

    def apply(self, hosts: dict[str, dict[str, str]]) -> None:
        """Mark pods Envoy has ejected not ready, and ready again once released."""
        now_ejected: set[tuple[str, str]] = set()
        for pool in self._datastore.pools.values():
            flags = hosts.get(pool.cluster_name)
            if not flags:
                continue
            for address, pod in pool.pods.items():
                if ejected(flags.get(address, "")):
                    now_ejected.add((pool.name, address))
                    if pool.table.ready[pod.row]:
                        pool.table.ready[pod.row] = False
                        log.warning(
                            "pod %s (pool %s) ejected by Envoy: not ready", address, pool.name
                        )
        for pool_name, address in self._ejected - now_ejected:
            pool = self._datastore.pools.get(pool_name)
            pod = pool.pods.get(address) if pool is not None else None
            if pod is not None and not pool.table.ready[pod.row]:
                pool.table.ready[pod.row] = True
                log.info("pod %s (pool %s) released by Envoy: ready again", address, pool_name)
        self._ejected = now_ejected

    def forget_removed_pools(self) -> None:
        """After a config switch: ejections of pools that no longer exist do not count."""
        self._ejected = {k for k in self._ejected if k[0] in self._datastore.pools}
