"""Admission: hold requests in a bounded per-pool queue while every pod is saturated.

Sending more work to saturated engines only lengthens their queues (and, past
the KV limit, makes them preempt), so the gateway holds requests itself, where
it can order them: highest priority first, first come first served within a
priority. Sheddable requests are refused at once with 429.

Waiters are released one at a time while the pool is not saturated. Each
release is re-checked when the released request is dispatched (the
scheduler's dispatch/complete listener), so releases are clocked by the
gateway's own in-flight accounting rather than by stale scrapes, and a
periodic re-check (every 20 ms while anyone waits) catches what only a new
scrape shows. Everything is bounded: the queue length (`queueSize`), each
wait (`queueTimeout`), and dead entries left by cancelled waiters.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from picker.datastore import Pool
from picker.scheduling.errors import NoReadyEndpoint, Overloaded, QueueTimeout
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import pool_saturated

if TYPE_CHECKING:
    from picker.scheduling.scheduler import Scheduler

log = logging.getLogger("picker.scheduling.admission")

RECHECK_INTERVAL_S = 0.02
RETRY_AFTER_S = 1


class _Waiter:
    __slots__ = ("future", "granted", "priority", "removed")

    def __init__(self, future: asyncio.Future[None], priority: int) -> None:
        self.future = future
        self.priority = priority
        self.granted = False
        self.removed = False


class AdmissionQueue:
    """Bounded priority queue of requests waiting for a pool to have room."""

    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        saturated: Callable[[float], bool] | None = None,
    ) -> None:
        self.pool = pool
        self._scheduler = scheduler
        self._clock = clock
        self._saturated = saturated or (lambda now: pool_saturated(self.pool, now))
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._live = 0
        self._scheduled = False
        self._closed = False
        self._ticker: asyncio.Task[None] | None = None
        if scheduler is not None:
            scheduler.add_listener(self.notify)

    def __len__(self) -> int:
        """Requests waiting now."""
        return self._live

    async def acquire(self, req: SchedulingRequest, timeout: float | None = None) -> None:
        """Return when `req` may be picked; raise Overloaded (429) or QueueTimeout (503).

        Returns at once when nobody waits and the pool is not saturated.
        `timeout` defaults to the pool's `saturation.queueTimeout`. Cancelling
        the caller (client gone) removes the waiter, or hands its turn on.
        """
        if self._closed:
            raise NoReadyEndpoint(f"pool {self.pool.name} was removed", retry_after=RETRY_AFTER_S)
        if not self._live and not self._saturated(self._clock()):
            return
        cfg = self.pool.config.saturation
        if req.sheddable:
            raise Overloaded(
                f"pool {self.pool.name} is saturated; request shed", retry_after=RETRY_AFTER_S
            )
        if self._live >= cfg.queue_size:
            raise Overloaded(
                f"pool {self.pool.name} is saturated and its queue is full",
                retry_after=RETRY_AFTER_S,
            )
        waiter = self._enqueue(req)
        wait_s = cfg.queue_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(wait_s):
                await waiter.future
        except TimeoutError:
            self._withdraw(waiter)
            raise QueueTimeout(
                f"pool {self.pool.name}: no capacity within {wait_s:g}s", retry_after=RETRY_AFTER_S
            ) from None
        except BaseException:
            self._withdraw(waiter)
            raise

    def notify(self) -> None:
        """Something changed (a dispatch, a completion): re-check soon. Cheap, idempotent."""
        if not self._live or self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._release()
            return
        self._scheduled = True
        loop.call_soon(self._release)

    def close(self) -> None:
        """The pool left the config: fail every waiter with 503 and stop."""
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.remove_listener(self.notify)
        for _, _, waiter in self._heap:
            if not waiter.removed and not waiter.future.done():
                waiter.future.set_exception(
                    NoReadyEndpoint(f"pool {self.pool.name} was removed", retry_after=1)
                )
        self._heap.clear()
        self._live = 0
        if self._ticker is not None:
            self._ticker.cancel()

    # -- internals ---------------------------------------------------------------

    def _enqueue(self, req: SchedulingRequest) -> _Waiter:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), req.priority)
        heapq.heappush(self._heap, (-req.priority, next(self._seq), waiter))
        self._live += 1
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._recheck())
        log.debug(
            "admission queued pool=%s priority=%d waiting=%d",
            self.pool.name, req.priority, self._live,
        )
        return waiter

    def _withdraw(self, waiter: _Waiter) -> None:
        """The waiter leaves (timeout, cancel): drop it, or pass on a turn it was given."""
        if waiter.granted:
            self.notify()
            return
        if not waiter.removed:
            waiter.removed = True
            self._live -= 1
            self._compact()

    def _compact(self) -> None:
        """Bound the dead entries cancelled waiters leave in the heap."""
        if len(self._heap) > 2 * self._live + 32:
            self._heap = [e for e in self._heap if not e[2].removed]
            heapq.heapify(self._heap)

    def _release(self) -> None:
        """Grant the best waiter if the pool has room (one per call; see module doc)."""
        self._scheduled = False
        heap = self._heap
        while heap and heap[0][2].removed:
            heapq.heappop(heap)
        if not heap or self._saturated(self._clock()):
            return
        _, _, waiter = heapq.heappop(heap)
        self._live -= 1
        waiter.granted = True
        if not waiter.future.done():
            waiter.future.set_result(None)

    async def _recheck(self) -> None:
        """While anyone waits, re-check saturation periodically (scrapes change it too)."""
        while self._live > 0 and not self._closed:
            await asyncio.sleep(RECHECK_INTERVAL_S)
            self._release()
