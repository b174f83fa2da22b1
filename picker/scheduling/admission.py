"""Admission: hold requests in a bounded per-pool queue while the pool has no room.

Sending more work to busy engines only lengthens their queues (and, past the
KV limit, makes them preempt), so the gateway holds requests itself, where it
can order them (picker.scheduling.fair_queue): priority bands first, weighted
fair shares between tenants within a band, first come first served within a
tenant. Sheddable requests are refused at once with 429.

A pool has no room for a request when every candidate pod is saturated by
its engine signals (picker.scheduling.saturation) or no pod can take it
within the flow-control bound on committed work (picker.scheduling.flow).
Waiters are released while the next one has room, each dispatched inside the
release (the director's pick runs there), so the next is judged on the work
just committed; re-checked on every dispatch and completion (the scheduler's
dispatch/complete listener), so releases are clocked by the gateway's own
accounting rather than by stale scrapes, and a periodic re-check (every
20 ms while anyone waits) catches what only a new scrape shows (a drained
prefill backlog). Everything is bounded: the queue length (`queueSize`),
each wait (`queueTimeout`), and dead entries left by cancelled waiters.

A tenant holding its share of the pool's batch slots (picker.scheduling.shares)
has no room even when a pod does: the release then skips its waiters and
grants the next in fair order among the tenants within their shares, so a
tenant over its share cannot block the queue's head. A newcomer that must
queue behind others is judged at once (not at the next dispatch or tick):
it may be the one with room.

The decisions (must a request wait, which waiter leaves next, whom a full
queue refuses) are `Admission`'s, which neither waits nor reads a clock: the
asyncio `AdmissionQueue` the director uses adds the futures, timeouts and the
periodic re-check around it, and the scenario family's twin (bench/twin.py)
drives the same class in virtual time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from picker.datastore import Pool
from picker.scheduling.errors import NoReadyEndpoint, Overloaded, QueueTimeout
from picker.scheduling.fair_queue import Entry, FairQueue
from picker.scheduling.flow import has_room, shared_slots, tenant_capped
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import pool_saturated

if TYPE_CHECKING:
    from picker.scheduling.scheduler import Scheduler

log = logging.getLogger("picker.scheduling.admission")

RECHECK_INTERVAL_S = 0.02
RETRY_AFTER_S = 1


class Held(Protocol):
    """What waits in admission: a request, and its place in the queue once held."""

    request: SchedulingRequest
    entry: Entry | None


H = TypeVar("H", bound=Held)


class Admission(Generic[H]):
    """One pool's admission decisions over the requests it holds, in fair order.

    Nothing here waits or reads a clock (every call is given `now`): who waits
    and who leaves is decided the same whether the caller is the live queue
    below or a simulation in virtual time.
    """

    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler | None = None,
        *,
        saturated: Callable[[float], bool] | None = None,
    ) -> None:
        """`saturated` (tests) replaces the whole room test with a switch over time."""
        self.pool = pool
        self._scheduler = scheduler
        self._saturated = saturated
        self._queue: FairQueue[H] = FairQueue()

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._queue)

    def blocked(self, req: SchedulingRequest, now: float) -> bool:
        """`req` must wait: others already wait (a newcomer must not overtake them),
        or the pool has no room for it. Counts `req`'s tenant as active (shares)."""
        if self._scheduler is not None:
            self._scheduler.state.shares.seen(
                req.tenant, req.tenant_weight, now,
                self.pool.config.saturation.fair_share_window_s)
        return len(self._queue) > 0 or not self._room(req, now)

    def must_wait(self, req: SchedulingRequest, now: float) -> bool:
        """`blocked`, and a blocked sheddable request is refused (429) rather than held."""
        if not self.blocked(req, now):
            return False
        if req.sheddable:
            raise Overloaded(
                f"pool {self.pool.name} is saturated; request shed", retry_after=RETRY_AFTER_S
            )
        return True

    def _room(self, req: SchedulingRequest, now: float) -> bool:
        if self._saturated is not None:
            return not self._saturated(now)
        if pool_saturated(self.pool, now):
            return False
        return self._scheduler is None or has_room(self._scheduler.state, req, now)

    def hold(self, item: H) -> H | None:
        """Queue `item` (its `entry` set). A full queue refuses it (Overloaded, 429), or
        refuses in its place the waiter with the least claim to its place
        (fair_queue.FairQueue.displace), which is returned, out of the queue."""
        req = item.request
        victim = None
        size = self.pool.config.saturation.queue_size
        if len(self._queue) >= size:
            victim = self._queue.displace(
                req.priority, req.tenant, req.tenant_weight, float(req.prompt_tokens)
            ) if size > 0 else None
            if victim is None:
                raise self.full()
        item.entry = self._queue.push(
            item, req.priority, req.tenant, req.tenant_weight, float(req.prompt_tokens)
        )
        log.debug(
            "admission queued pool=%s priority=%d tenant=%s waiting=%d",
            self.pool.name, req.priority, req.tenant, len(self._queue),
        )
        return victim

    def full(self) -> Overloaded:
        """The refusal of a request a full queue has no place for."""
        return Overloaded(
            f"pool {self.pool.name} is saturated and its queue is full",
            retry_after=RETRY_AFTER_S,
        )

    def withdraw(self, item: H) -> None:
        """`item` leaves the queue without being released (timeout, cancel); idempotent."""
        if item.entry is not None:
            self._queue.remove(item.entry)

    def release(self, now: float) -> H | None:
        """The next waiter, taken out of the queue, if the pool has room for it now: the
        fair queue's head, or, when its tenant holds its share of the slots, the next in
        fair order among the tenants within theirs. None: nobody may leave now."""
        head = self._queue.peek()
        if head is None:
            return None
        state = self._scheduler.state if self._scheduler is not None else None
        slots = shared_slots(state, now) if state is not None else 0.0
        if state is not None and tenant_capped(state, head.tenant, now, slots):
            capped = {t for t in self._queue.tenants() if tenant_capped(state, t, now, slots)}
            head = self._queue.peek_excluding(capped)
        if head is None or not self._room(head.item.request, now):
            return None
        return self._queue.take(head)


class _Waiter:
    __slots__ = ("dispatched", "entry", "future", "granted", "on_grant", "request")

    def __init__(self, future: asyncio.Future[None], request: SchedulingRequest,
                 on_grant: Callable[[], None] | None) -> None:
        self.future = future
        self.request = request
        self.on_grant = on_grant
        self.granted = False
        self.dispatched = False  # on_grant ran: the request is dispatched, whatever follows
        self.entry: Entry[_Waiter] | None = None


class AdmissionQueue(Admission[_Waiter]):
    """Bounded, fairly ordered queue of requests waiting for a pool to have room."""

    def __init__(
        self,
        pool: Pool,
        scheduler: Scheduler | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        saturated: Callable[[float], bool] | None = None,
    ) -> None:
        """`saturated` (tests) replaces the whole room test with a switch over time."""
        super().__init__(pool, scheduler, saturated=saturated)
        self._clock = clock
        # The waiter granted a turn whose caller has not resumed (and so not dispatched)
        # yet: no other is granted meanwhile, since room is judged on dispatched work.
        self._granted: _Waiter | None = None
        self._scheduled = False
        self._closed = False
        self._ticker: asyncio.Task[None] | None = None
        if scheduler is not None:
            scheduler.add_listener(self.notify)

    async def acquire(self, req: SchedulingRequest, timeout: float | None = None,
                      on_grant: Callable[[], None] | None = None) -> bool:
        """Return when `req` may be picked; raise Overloaded (429) or QueueTimeout (503).

        Returns at once (False) when nobody waits and the pool has room for it.
        `on_grant` dispatches the request: given, the release runs it at once, inside
        the release, and goes on with the next waiter the pool still has room for, and
        acquire returns True (dispatched; an error it raised is acquire's). Without it
        the release waits for this caller to resume and dispatch before judging the
        next: one waiter per two loop iterations, which a busy loop turned into ~140
        releases/s. `timeout` defaults to the pool's `saturation.queueTimeout`.
        Cancelling the caller (client gone) removes the waiter, or hands its turn on;
        a waiter already dispatched stays dispatched (its caller must end it).
        """
        if self._closed:
            raise NoReadyEndpoint(f"pool {self.pool.name} was removed", retry_after=RETRY_AFTER_S)
        if not self.must_wait(req, self._clock()):
            return False
        waiter = self._enqueue(req, on_grant)
        self.notify()
        cfg = self.pool.config.saturation
        wait_s = cfg.queue_timeout_s if timeout is None else timeout
        try:
            async with asyncio.timeout(wait_s):
                await waiter.future
            self._resumed(waiter)
        except TimeoutError:
            if waiter.dispatched:  # released just as the timeout fired: it is on its way
                return True
            self._withdraw(waiter)
            raise QueueTimeout(
                f"pool {self.pool.name}: no capacity within {wait_s:g}s", retry_after=RETRY_AFTER_S
            ) from None
        except BaseException:
            self._withdraw(waiter)
            raise
        return waiter.dispatched

    def notify(self) -> None:
        """Something changed (a dispatch, a completion): re-check soon. Cheap, idempotent."""
        if not len(self._queue) or self._scheduled:
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
        for waiter in self._queue.items():
            if not waiter.future.done():
                waiter.future.set_exception(
                    NoReadyEndpoint(f"pool {self.pool.name} was removed", retry_after=1)
                )
        self._queue.clear()
        if self._ticker is not None:
            self._ticker.cancel()

    # -- internals ---------------------------------------------------------------

    def _enqueue(self, req: SchedulingRequest,
                 on_grant: Callable[[], None] | None = None) -> _Waiter:
        """Hold `req` (a full queue refuses it or the waiter it displaces, Overloaded)."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), req, on_grant)
        victim = self.hold(waiter)
        if victim is not None and not victim.future.done():
            victim.future.set_exception(self.full())
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._recheck())
        return waiter

    def _resumed(self, waiter: _Waiter) -> None:
        """`waiter`'s caller runs again: it dispatches now, so the next may be judged."""
        if self._granted is waiter:
            self._granted = None

    def _withdraw(self, waiter: _Waiter) -> None:
        """The waiter leaves (timeout, cancel): drop it, or pass on a turn it was given."""
        if waiter.granted:
            self._resumed(waiter)
            self.notify()
            return
        self.withdraw(waiter)

    def _release(self) -> None:
        """Grant waiters while the pool has room: each one's dispatch (`on_grant`) runs
        here, so the next is judged on it at once; a waiter without one is granted
        alone, and its caller's dispatch (a listener call) asks for the next look."""
        self._scheduled = False
        while self._granted is None and len(self._queue):
            waiter = self.release(self._clock())
            if waiter is None:
                return
            if waiter.future.done():  # refused meanwhile (displaced, the pool removed)
                continue
            if waiter.on_grant is None:
                waiter.granted = True
                self._granted = waiter
                waiter.future.set_result(None)
                return
            try:
                waiter.on_grant()
            except Exception as exc:  # e.g. no pod left for it: that waiter's answer
                waiter.future.set_exception(exc)
                continue
            waiter.dispatched = True
            waiter.future.set_result(None)

    async def _recheck(self) -> None:
        """While anyone waits, re-check room periodically (scrapes change it too)."""
        while len(self._queue) > 0 and not self._closed:
            await asyncio.sleep(RECHECK_INTERVAL_S)
            self._release()
