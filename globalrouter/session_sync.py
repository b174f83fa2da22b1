"""Session bindings shared between global-router replicas through the coordination Redis.

Each replica keeps its own `x-session-id` → region map (globalrouter.affinity). Behind an
NLB a conversation whose turns open new connections lands on any replica; without this,
a replica that never saw the session placed it by the policy, possibly elsewhere, and
the conversation lost its cache. Now every replica appends the bindings it makes (new,
moved, or refreshed once per half idle timeout) to a bounded local outbox; a background
task publishes them in one XADD every `FLUSH_S` to one capped stream, and reads the
others' entries from the same stream into its own map. At start a replica reads the last
`WARM_ENTRIES` entries, so one that joins late knows the live sessions.

Never on the request path: `record` appends to a bounded deque; a slow, partitioned or
dead Redis only delays what the other replicas learn (the outbox drops its oldest entries
when full, a batch Redis refused is not resent: its sessions are told again when they
move or at their next refresh), reconnects with backoff, and is counted in the router's
metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from globalrouter.affinity import RegionAffinity
from picker.cancellation import cancel_and_wait
from picker.coordination.backoff import Backoff

log = logging.getLogger("globalrouter.session_sync")

FLUSH_S = 0.1
# Bindings waiting to be published; the oldest go first when Redis is away this long.
OUTBOX_MAX = 10_000
# The stream keeps about this many entries (XADD MAXLEN ~): minutes of bindings.
STREAM_MAXLEN = 10_000
READ_COUNT = 500
WARM_ENTRIES = 1_000
STOP_TIMEOUT_S = 2.0


def encode(bindings: list[tuple[str, str]]) -> bytes:
    """`session\\tregion` lines: a session id has no tab or newline (it is a header value
    checked by affinity); a region name is a DNS label."""
    return "\n".join(f"{s}\t{r}" for s, r in bindings).encode()


def decode(blob: bytes) -> list[tuple[str, str]]:
    """The bindings of one entry; lines that are not `session\\tregion` are skipped."""
    out = []
    for line in blob.decode("utf-8", "replace").split("\n"):
        session, sep, region = line.partition("\t")
        if sep and session and region:
            out.append((session, region))
    return out


class SessionSync:
    """One router replica's exchange of session bindings."""

    def __init__(self, affinity: RegionAffinity, names: tuple[str, ...],
                 redis: Callable[[], Any], prefix: str, replica: str) -> None:
        self.affinity = affinity
        self.rows = {name: row for row, name in enumerate(names)}
        self.names = names
        self._factory = redis
        self.key = f"{prefix}:sessions"
        self.replica = replica.encode()
        self.outbox: deque[tuple[str, str]] = deque(maxlen=OUTBOX_MAX)
        self.client: Any = None
        self.connected = False
        self.published = 0
        self.adopted = 0
        self.errors = 0
        self._last_id = b"0-0"
        self._task: asyncio.Task[None] | None = None

    def record(self, session: str, row: int) -> None:
        """A binding to publish (called by the director, on the request path: O(1))."""
        self.outbox.append((session, self.names[row]))

    async def start(self) -> None:
        self.client = self._factory()
        self._task = asyncio.create_task(self._run(), name="session-sync")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], STOP_TIMEOUT_S)
            self._task = None
        if self.client is not None:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self.client.aclose()
            self.client = None

    def stats(self) -> dict[str, Any]:
        return {"connected": self.connected, "published": self.published,
                "adopted": self.adopted, "errors": self.errors, "pending": len(self.outbox)}

    async def _run(self) -> None:
        backoff = Backoff()
        warm = True
        while True:
            try:
                if warm:
                    await self._warm()
                    warm = False
                await self.exchange()
            except Exception as exc:  # Redis down, slow, or an answer it cannot read:
                # whatever it is, retry later; sessions are then only this replica's
                self.errors += 1
                if self.connected:
                    log.warning("session sync failed, retrying with backoff: %s: %s",
                                type(exc).__name__, str(exc)[:200])
                self.connected = False
                await backoff.sleep()
                continue
            if not self.connected:
                log.info("session sync connected")
            self.connected = True
            backoff.reset()
            await asyncio.sleep(FLUSH_S)

    async def _warm(self) -> None:
        """The last entries first (a replica that joins late knows the live sessions),
        then reading goes on after the newest."""
        entries = await self.client.xrevrange(self.key, count=WARM_ENTRIES)
        self._fold(reversed(entries))

    async def exchange(self) -> None:
        """Publish what is pending in one XADD, then take in the others' new entries."""
        if self.outbox:
            # taken before the call: a batch Redis refused is not sent again (its sessions
            # are told again when they move or at their next refresh)
            batch = list(self.outbox)
            self.outbox.clear()
            await self.client.xadd(self.key, {b"r": self.replica, b"b": encode(batch)},
                                   maxlen=STREAM_MAXLEN, approximate=True)
            self.published += len(batch)
        while True:
            reply = await self.client.xread({self.key: self._last_id}, count=READ_COUNT)
            entries = reply[0][1] if reply else []
            self._fold(entries)
            if len(entries) < READ_COUNT:
                return

    def _fold(self, entries: Any) -> None:
        now = time.monotonic()  # the director's clock
        for entry_id, fields in entries:
            self._last_id = entry_id
            if fields.get(b"r") == self.replica:
                continue
            for session, region in decode(fields.get(b"b", b"")):
                row = self.rows.get(region)
                if row is not None:
                    self.affinity.adopt(session, row, now)
                    self.adopted += 1
