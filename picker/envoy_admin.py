"""What the picker reads from Envoy's admin port (loopback): applied xDS, outlier ejections.

Two questions, both off the request path:

- *Has Envoy taken a config?* After the picker writes new CDS/RDS/EDS files, it
  waits until `/config_dump` shows the route version and `/clusters` lists every
  pool cluster and member, and only then routes requests to a new pool or pod.
- *Which pods has Envoy ejected?* Envoy's passive outlier detection sees every
  upstream attempt (the picker does not: it processes no response phase). A pod
  Envoy ejected after consecutive 5xx or gateway failures shows
  `/failed_outlier_check` in `/clusters`; the picker polls that and stops picking
  the pod until Envoy lets it back (`override_host` itself ignores ejections:
  measured, an ejected pod named in the header still got every request).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp
import orjson

log = logging.getLogger("picker.envoy_admin")

OUTLIER_FLAG = "/failed_outlier_check"
TIMEOUT_S = 2.0


class EnvoyAdmin:
    """A small client of Envoy's admin API on 127.0.0.1:`port`."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=2),
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str, params: dict[str, str] | None = None) -> bytes | None:
        try:
            async with self._client().get(self.base + path, params=params) as resp:
                if resp.status != 200:
                    return None
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def hosts(self) -> dict[str, dict[str, str]] | None:
        """cluster → {ip:port → health flags} from `/clusters`; None if Envoy is unreachable."""
        body = await self._get("/clusters")
        if body is None:
            return None
        return parse_clusters(body.decode("utf-8", "replace"))

    async def route_versions(self) -> set[str] | None:
        """version_info of every dynamic route configuration Envoy runs."""
        body = await self._get("/config_dump", {"resource": "dynamic_route_configs"})
        if body is None:
            return None
        try:
            dump = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        return {c.get("version_info", "") for c in dump.get("configs", [])}

    async def has_applied(self, rds_version: str, members: dict[str, Iterable[str]]) -> bool:
        """True once Envoy runs routes `rds_version` and every cluster with every member."""
        versions = await self.route_versions()
        if versions is None or rds_version not in versions:
            return False
        hosts = await self.hosts()
        if hosts is None:
            return False
        return all(
            cluster in hosts and set(addresses) <= set(hosts[cluster])
            for cluster, addresses in members.items()
        )

    async def wait_applied(
        self, rds_version: str, members: dict[str, Iterable[str]], timeout_s: float
    ) -> bool:
        """Poll `has_applied` every 50 ms up to `timeout_s`; False on timeout."""
        members = {c: list(a) for c, a in members.items()}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.has_applied(rds_version, members):
                return True
            await asyncio.sleep(0.05)
        return False


def parse_clusters(text: str) -> dict[str, dict[str, str]]:
    """`/clusters` text → cluster → {host → health flags}.

    Lines look like `pool_a::127.0.0.1:8000::health_flags::/failed_outlier_check`
    (`healthy` when nothing is wrong); IPv6 hosts are `[::1]:8000`.
    """
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        cluster, sep, rest = line.partition("::")
        if not sep:
            continue
        host, sep, rest = rest.rpartition("::health_flags::")
        if sep:
            out.setdefault(cluster, {})[host] = rest.strip()
        elif "::" in rest:
            out.setdefault(cluster, {})
    return out


def ejected(flags: str) -> bool:
    return OUTLIER_FLAG in flags
