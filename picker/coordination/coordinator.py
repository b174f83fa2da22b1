"""The coordination lifecycle of one replica: connect, flush, read, sweep, reconnect.

Tasks, all off the request path:
- the link (`_run`): connect; then, until the first failure, flush the outbox
  (woken by its first event; a batch gathers until `flushInterval` after the
  last one, `_gather`; one pipelined round trip; a heartbeat entry every
  `heartbeatInterval` when idle),
  read the peers' streams (XREAD BLOCK from each position) and fold what
  comes, and store a snapshot every `snapshotInterval`. On a failure it
  reconnects after a capped, jittered exponential backoff (50 ms doubling to
  2 s); positions are kept, so the streams replay what was missed;
- the sweep, independent of the link: every `heartbeatInterval`, releases
  the work of peers silent for `replicaTimeout` (so with Redis down the
  replica soon routes on its own requests only).
While Redis is down the outbox keeps the newest `bufferSize` events; they are
sent on reconnect (a completion late is still a completion).
Given the collector and `shareScrapes`, the flushes also carry this replica's
scrape results for the pods it owns, and the fold writes the others' into
the rows (picker.coordination.scrapes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contract.config import CoordinationConfig, GatewayConfig
from picker.cancellation import cancel_and_wait
from picker.coordination import snapshot
from picker.coordination.backoff import Backoff
from picker.coordination.bus import Bus, BusError
from picker.coordination.clock import ServerClock
from picker.coordination.codec import CodecError, decode_batch, encode_batches
from picker.coordination.fold import Folder
from picker.coordination.outbox import Outbox
from picker.coordination.replicas import Replicas, default_replica_id
from picker.coordination.scrapes import SharedScrapes

if TYPE_CHECKING:
    from picker.datalayer.collector import MetricsCollector
    from picker.director import Director

log = logging.getLogger("picker.coordination")

# A final flush and bye on stop get this long at most (the process is exiting).
STOP_TIMEOUT_S = 1.0
# Cancelled loops end within this (one blocked in XREAD ends at once; see cancellation).
TASKS_END_TIMEOUT_S = 2.0


@dataclass(slots=True)
class CoordinationStats:
    """Counters for metrics and `igw status` (plain numbers: read at scrape time)."""

    connected: bool = False
    batches_sent: int = 0
    events_sent: int = 0
    batches_received: int = 0
    events_received: int = 0
    send_failed: int = 0  # events of batches whose send failed
    decode_errors: int = 0
    reconnects: int = 0
    lag_s: float = math.nan  # age of the newest remote batch folded
    last_error: str = ""
    snapshot_loaded: bool = False
    scrapes_sent: int = 0  # shared scrape results in batches sent


class Coordinator:
    """Shares this replica's routing with the others and folds theirs in."""

    def __init__(
        self, config: GatewayConfig, director: Director, replica: str | None = None,
        collector: MetricsCollector | None = None, wall_clock: Callable[[], float] = time.time,
    ) -> None:
        assert config.coordination is not None
        self.settings: CoordinationConfig = config.coordination
        self.director = director
        self.replica = replica or default_replica_id()
        self.stats = CoordinationStats()
        self.outbox = Outbox(self.settings.buffer_size)
        self.replicas = Replicas(self.replica, self.settings.replica_timeout_s)
        # Scrape results shared with the others: needs the collector that scrapes.
        self.scrapes = SharedScrapes(
            self.replica, self.replicas, self.outbox, collector,
            lambda: self.stats.connected, self.settings.flush_interval_s,
        ) if collector is not None and self.settings.share_scrapes else None
        self.folder = Folder(director, self.replicas, self.scrapes)
        self.bus = Bus(self.settings, config.coordination_prefix, self.replica,
                       block_s=self.settings.heartbeat_interval_s)
        self.positions: dict[str, bytes] = {}
        # Entries are aged on the Redis server's clock (picker.coordination.clock).
        self.clock = ServerClock()
        self._wall = wall_clock
        self._seq = 0
        self._warmed = False
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start sharing: the director records into the outbox from now on."""
        self.director.outbox = self.outbox
        if self.scrapes is not None:
            self.scrapes.attach()
        self._tasks = [
            asyncio.create_task(self._run(), name="igw-coordination-link"),
            asyncio.create_task(self._sweep(), name="igw-coordination-sweep"),
        ]
        log.info("coordination replica=%s url=%s", self.replica, _safe_url(self.settings.url))

    async def stop(self) -> None:
        """Send what is buffered and a bye (bounded), then close. Call after draining:
        the completions of the drained requests are in that last flush."""
        self.director.outbox = None
        if self.scrapes is not None:  # no one shares with this replica any more
            self.scrapes.detach()
        await cancel_and_wait(self._tasks, TASKS_END_TIMEOUT_S)
        self._tasks = []
        if self.stats.connected:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self._flush(bye=True)
                    await self.bus.leave()
            except (BusError, TimeoutError) as exc:
                log.debug("coordination bye not sent: %s", exc)
        self.stats.connected = False
        await self.bus.close()

    # -- the link ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        while True:
            started = loop.time()
            try:
                await self.bus.connect()
                self.stats.connected = True
                log.info("coordination connected replica=%s", self.replica)
                if not self._warmed:
                    await self._warm()
                await _first_failure(self._flush_loop(), self._read_loop(),
                                     self._snapshot_loop())
            except BusError as exc:
                if self.stats.connected or not self.stats.last_error:
                    log.warning("coordination lost, routing on local state: %s", exc)
                self.stats.last_error = str(exc)[:200]
            if self.stats.connected:
                self.stats.reconnects += 1
            self.stats.connected = False
            if loop.time() - started > backoff.max_s:
                backoff.reset()
            await backoff.sleep()

    async def _warm(self) -> None:
        """First connection: load the newest snapshot, start the streams where it says."""
        fields = await self.bus.get_snapshot()
        self._warmed = True
        if not fields:
            return
        try:
            positions = snapshot.apply(self.director, fields, time.monotonic())
        except CodecError as exc:
            log.warning("coordination snapshot ignored: %s", exc)
            return
        positions.pop(self.replica, None)
        self.positions.update(positions)
        self.stats.snapshot_loaded = True
        log.info("coordination warm start from snapshot: streams=%d", len(positions))

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        outbox, heartbeat = self.outbox, self.settings.heartbeat_interval_s
        next_beat = 0.0
        dispatched = flushed = -math.inf  # when the last batch with dispatches / any left
        while True:
            wait = next_beat - loop.time()
            if wait > 0 and not outbox.ready.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await outbox.ready.wait()
            if len(outbox):
                await self._gather(dispatched, flushed)
                flushed = loop.time()
                if outbox.dispatch_ready.is_set():
                    dispatched = flushed
            beat = loop.time() >= next_beat
            if beat:
                next_beat = loop.time() + heartbeat
            await self._flush(beat=beat)

    async def _gather(self, dispatched: float, flushed: float) -> None:
        """Wait until the waiting batch may leave. One with a dispatch leaves
        flushInterval after the last batch with a dispatch, at once after a quiet
        interval: replicas that picked on a view without the others' last sends herded
        onto the same emptiest-looking pod (docs/benchmarks.md, herding). One of
        completions and scrape results only gathers until flushInterval after the last
        batch of any kind, and a dispatch arriving meanwhile takes it over: an owner's
        scrape results (tens a second) no longer hold its dispatches back. So at most two
        batches per flushInterval, heartbeats aside, one of them with dispatches."""
        loop = asyncio.get_running_loop()
        interval, ready = self.settings.flush_interval_s, self.outbox.dispatch_ready
        while not ready.is_set():
            wait = flushed + interval - loop.time()
            if wait <= 0:
                return
            try:
                async with asyncio.timeout(wait):
                    await ready.wait()
            except TimeoutError:
                return
        wait = dispatched + interval - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _flush(self, *, beat: bool = False, bye: bool = False) -> None:
        events = self.outbox.take()
        scrapes = self.outbox.take_scrapes(time.monotonic())
        if not events and not scrapes and not beat and not bye:
            return
        wall = self._wall()
        entries = encode_batches(events, self._seq, wall, bye=bye, scrapes=scrapes,
                                 shares_scrapes=self.settings.share_scrapes)
        try:
            await self.bus.publish(entries, heartbeat_at=wall if beat else None)
        except BusError:
            self.stats.send_failed += len(events)
            raise
        self.clock.observe(wall, self._wall(), self.bus.last_written)
        self._seq += len(entries)
        self.stats.batches_sent += len(entries)
        self.stats.events_sent += len(events)
        self.stats.scrapes_sent += len(scrapes)

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self.settings.heartbeat_interval_s
        next_peers = 0.0
        while True:
            if loop.time() >= next_peers:
                await self._refresh_peers()
                next_peers = loop.time() + heartbeat
            if not self.positions:
                await asyncio.sleep(max(0.0, next_peers - loop.time()))
                continue
            entries = await self.bus.read(self.positions)
            now, wall = time.monotonic(), self._wall()
            for replica, entry_id, fields in entries:
                self.positions[replica] = entry_id
                try:
                    batch = decode_batch(fields)
                except CodecError as exc:
                    self.stats.decode_errors += 1
                    log.debug("coordination entry skipped replica=%s: %s", replica, exc)
                    continue
                age = self.clock.age_s(entry_id, wall, batch.sent_at)
                self.folder.fold(replica, batch, now, age)
                self.stats.batches_received += 1
                self.stats.events_received += len(batch.dispatches) + len(batch.completions)
                self.stats.lag_s = age

    async def _refresh_peers(self) -> None:
        """Streams to read: every registered peer (a new one from its beginning)."""
        peers = set(await self.bus.peers(self._wall()))
        for name in [n for n in self.positions if n not in peers]:
            del self.positions[name]
        for name in peers:
            self.positions.setdefault(name, b"0-0")

    async def _snapshot_loop(self) -> None:
        interval = self.settings.snapshot_interval_s
        while True:
            await asyncio.sleep(interval * random.uniform(0.8, 1.2))
            positions = {**self.positions, self.replica: self.bus.last_written}
            fields = snapshot.build(self.director, positions, time.monotonic(), self._wall())
            await self.bus.put_snapshot(fields, ttl_s=3 * interval)

    # -- liveness ----------------------------------------------------------------------

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            self.replicas.sweep(time.monotonic())

    # -- reading -----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What `igw status` and the metrics show."""
        s = self.stats
        return {
            "replica": self.replica,
            "connected": s.connected,
            "peers": self.replicas.live(time.monotonic()),
            "remote_inflight": self.replicas.outstanding(),
            "lag_s": s.lag_s,
            "buffered": len(self.outbox),
            "dropped": self.outbox.dropped,
            "send_failed": s.send_failed,
            "reconnects": s.reconnects,
            "last_error": s.last_error,
            "snapshot_loaded": s.snapshot_loaded,
            **self._scrape_status(),
        }

    def _scrape_status(self) -> dict[str, Any]:
        """Pods this replica scrapes as their owner, receives, or scrapes as a fallback."""
        if self.scrapes is None:
            return {"share_scrapes": False}
        roles = self.scrapes.roles()
        return {"share_scrapes": True, **{f"scrape_{role}": n for role, n in roles.items()}}


async def _first_failure(*coros: Coroutine[Any, Any, None]) -> None:
    """Run the loops together until one raises; the others are cancelled, it re-raises."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        await cancel_and_wait(tasks, TASKS_END_TIMEOUT_S)


def _safe_url(url: str) -> str:
    """The URL without any password written into it (never logged)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
