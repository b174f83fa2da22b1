"""Reads every region's load summary in the background, and measures its RTT.

One task per region: `GET https://ENDPOINT/igw/v1/load-summary` (the Tier-1
listener, verified with the region's CA and server name) every
`spec.polling.interval`, bounded by `spec.polling.timeout`. A failed poll
(refused, reset, not a summary) makes the region unknown at once, a timed-out
one from the second in a row; a poll outstanding longer than a bound derived
from the region's RTT makes it suspect (placed last) before its timeout;
a summary whose generation stopped moving ages out after
`spec.polling.staleAfter` (regions.RegionTable). The RTT is the poll's
duration on a kept-alive connection, the same TLS path the traffic takes.
Nothing here is on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

import aiohttp
import orjson

from contract import headers as hdr
from contract.global_config import ClientCertificate, GlobalRouterConfig, RegionConfig
from globalrouter.regions import RegionTable
from picker.cancellation import cancel_and_wait

log = logging.getLogger("globalrouter.poller")

# A summary is a few hundred bytes per pool; anything much larger is not one.
MAX_SUMMARY_BYTES = 1 << 20


class SummaryError(ValueError):
    """The region answered, but not with a load summary."""


def client_context(region: RegionConfig, client: ClientCertificate | None = None
                   ) -> ssl.SSLContext:
    """TLS to the region: its CA (else the system store), its name checked; the
    router's own certificate presented when mutual TLS is configured."""
    context = ssl.create_default_context(cafile=region.ca_file)
    if client is not None:
        context.load_cert_chain(client.certificate_file, client.key_file)
    return context


def parse_summary(body: bytes) -> dict[str, Any]:
    """The summary document, checked for the shape placement reads."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise SummaryError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise SummaryError("not a version 1 load summary")
    if not isinstance(doc.get("pools"), list) or not isinstance(doc.get("generation"), int):
        raise SummaryError("a load summary needs `pools` and `generation`")
    if not all(isinstance(p, dict) for p in doc["pools"]):
        raise SummaryError("every pool entry must be an object")
    return doc


class SummaryPoller:
    """Polls every region of `table` until stopped."""

    def __init__(self, config: GlobalRouterConfig, table: RegionTable) -> None:
        self.config = config
        self.table = table
        self._sessions: list[aiohttp.ClientSession] = []
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for row, region in enumerate(self.config.regions):
            context = client_context(region, self.config.region_client_tls)
            connector = aiohttp.TCPConnector(ssl=context, limit=2)
            session = aiohttp.ClientSession(connector=connector)
            self._sessions.append(session)
            self._tasks.append(
                asyncio.create_task(self._run(row, region, session), name=f"poll-{region.name}")
            )

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, timeout_s=5.0)
        for session in self._sessions:
            await session.close()

    async def _run(self, row: int, region: RegionConfig, session: aiohttp.ClientSession) -> None:
        url = f"https://{region.endpoint}{hdr.LOAD_SUMMARY_PATH}"
        was_fresh = False
        while True:
            started = time.monotonic()
            self.table.poll_sent(row, started)
            try:
                summary = await self._fetch(session, url, region)
            except (aiohttp.ClientError, TimeoutError, OSError, SummaryError) as exc:
                self.table.record_failure(row, f"{type(exc).__name__}: {exc}"[:300],
                                          definite=not isinstance(exc, TimeoutError))
            else:
                done = time.monotonic()
                self.table.record_ok(row, summary, done - started, done)
            fresh = bool(self.table.fresh(time.monotonic())[row])
            if fresh != was_fresh:
                log.info("region %s %s", region.name, "fresh" if fresh else
                         f"unknown ({self.table.status[row].error or 'stale summary'})")
                was_fresh = fresh
            interval = self.config.polling.interval_s  # a reload may change it
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _fetch(self, session: aiohttp.ClientSession, url: str, region: RegionConfig
                     ) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.config.polling.timeout_s)
        async with session.get(url, timeout=timeout, server_hostname=region.server_name) as r:
            body = await r.content.read(MAX_SUMMARY_BYTES + 1)
            if len(body) > MAX_SUMMARY_BYTES:
                raise SummaryError(f"summary larger than {MAX_SUMMARY_BYTES} bytes")
            if r.status == 503:  # draining: its body says serving false
                return parse_summary(body)
            if r.status != 200:
                raise SummaryError(f"HTTP {r.status}")
            return parse_summary(body)
