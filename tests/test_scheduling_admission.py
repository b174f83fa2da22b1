"""Saturation detection and the admission queue: order, bounds, timeouts, cancellation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from contract.config import SaturationConfig, SchedulerConfig
from contract.errors import NoReadyEndpoint, Overloaded, QueueTimeout
from picker.datastore import Pool
from picker.scheduling import AdmissionQueue, Scheduler, SchedulingRequest, pool_saturated
from picker.scheduling.saturation import saturated_pods

NOW = 1_000.0


def make_pool(n: int = 2, queue_size: int = 4, timeout: float = 5.0) -> Pool:
    endpoints = tuple(f"10.0.0.{i}:8000" for i in range(n))
    sat = SaturationConfig(queue_threshold=4, kv_cache_threshold=0.9, queue_size=queue_size,
                           queue_timeout_s=timeout)
    pool = Pool(SchedulerConfig(name="p", model_name="m", endpoints=endpoints, saturation=sat))
    pool.set_members(endpoints)
    for row in range(n):
        pool.mark_scrape(row, True, NOW)
    return pool


def req(priority: int = 0, sheddable: bool = False) -> SchedulingRequest:
    return SchedulingRequest("m", None, 10, 10, np.empty(0, np.uint64), priority, sheddable)


class Gate:
    """A saturation switch the test flips, standing in for scrapes."""

    def __init__(self, saturated: bool = True) -> None:
        self.saturated = saturated

    def __call__(self, now: float) -> bool:
        return self.saturated


# -- saturation -------------------------------------------------------------------------


def test_pod_saturated_by_engine_queue_or_kv_not_by_requests_in_flight():
    pool = make_pool(3)  # queueThreshold 4 in make_pool's config
    t = pool.table
    t.waiting[:3] = [4, 3, 0]
    t.dispatched[:3] = [0, 30, 0]  # in flight since the scrape: mostly running, not waiting
    t.kv_usage[:3] = [0.0, 0.0, 0.95]
    assert saturated_pods(pool)[:3].tolist() == [True, False, True]
    assert not pool_saturated(pool, NOW)
    t.waiting[1] = 4
    assert pool_saturated(pool, NOW)


def test_pool_saturation_ignores_unready_and_unknown():
    pool = make_pool(2)
    pool.table.waiting[0] = 10
    pool.table.ready[1] = False
    assert pool_saturated(pool, NOW)  # the only candidate is full
    pool.table.metrics_ok[:2] = False
    assert not pool_saturated(pool, NOW)  # no fresh pod: unknown, not saturated
    assert not pool_saturated(make_pool(0), NOW)


def test_queue_threshold_zero_disables_queue_test():
    pool = make_pool(1)
    pool.config = SchedulerConfig(name="p", model_name="m", endpoints=(),
                                  saturation=SaturationConfig(queue_threshold=0))
    pool.table.waiting[0] = 1_000
    assert not pool_saturated(pool, NOW)


# -- admission --------------------------------------------------------------------------


async def test_not_saturated_admits_immediately():
    queue = AdmissionQueue(make_pool(), saturated=Gate(False))
    await asyncio.wait_for(queue.acquire(req(), 1.0), 0.5)
    assert len(queue) == 0


async def test_sheddable_is_refused_with_429_when_saturated():
    queue = AdmissionQueue(make_pool(), saturated=Gate(True))
    with pytest.raises(Overloaded) as err:
        await queue.acquire(req(sheddable=True), 1.0)
    assert err.value.status == 429 and err.value.retry_after >= 1


async def test_full_queue_is_overloaded():
    queue = AdmissionQueue(make_pool(queue_size=2), saturated=Gate(True))
    waiters = [asyncio.create_task(queue.acquire(req(), 5.0)) for _ in range(2)]
    await asyncio.sleep(0)
    assert len(queue) == 2
    with pytest.raises(Overloaded):
        await queue.acquire(req(), 5.0)
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert len(queue) == 0


async def test_timeout_is_503_and_leaves_the_queue():
    queue = AdmissionQueue(make_pool(), saturated=Gate(True))
    with pytest.raises(QueueTimeout) as err:
        await queue.acquire(req(), 0.05)
    assert err.value.status == 503
    assert len(queue) == 0


async def test_released_by_priority_then_fifo():
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(queue_size=10), saturated=gate)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await queue.acquire(req(priority), 5.0)
        order.append(name)

    tasks = []
    for name, priority in (("a0", 0), ("b5", 5), ("c0", 0), ("d5", 5), ("e-1", -1)):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await asyncio.sleep(0)
    gate.saturated = False
    for _ in range(5):  # one release per notify (as each dispatch would call it)
        queue.notify()
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    assert order == ["b5", "d5", "a0", "c0", "e-1"]


async def test_periodic_recheck_releases_without_any_notify():
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(), saturated=gate)
    task = asyncio.create_task(queue.acquire(req(), 2.0))
    await asyncio.sleep(0.03)
    assert not task.done()
    gate.saturated = False  # e.g. a scrape showed the queues drained
    await asyncio.wait_for(task, 0.2)


async def test_scheduler_dispatch_and_complete_wake_the_queue():
    pool = make_pool(1)
    pool.table.waiting[0] = 10
    sched = Scheduler(pool)
    queue = AdmissionQueue(pool, sched)
    task = asyncio.create_task(queue.acquire(req(), 2.0))
    await asyncio.sleep(0)
    pool.table.waiting[0] = 0  # capacity appears...
    sched.on_complete(0, req(), NOW, 0.5, True)  # ...and a completion wakes the queue
    await asyncio.wait_for(task, 0.015)  # sooner than the periodic re-check


async def test_cancelled_waiter_is_removed_and_next_served():
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(), saturated=gate)
    first = asyncio.create_task(queue.acquire(req(5), 5.0))
    second = asyncio.create_task(queue.acquire(req(0), 5.0))
    await asyncio.sleep(0)
    first.cancel()  # the client went away
    await asyncio.gather(first, return_exceptions=True)
    assert len(queue) == 1
    gate.saturated = False
    queue.notify()
    await asyncio.wait_for(second, 0.5)


async def test_grant_to_a_cancelled_waiter_is_passed_on():
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(), saturated=gate)
    first = asyncio.create_task(queue.acquire(req(5), 5.0))
    second = asyncio.create_task(queue.acquire(req(0), 5.0))
    await asyncio.sleep(0)
    gate.saturated = False
    queue._release()  # grant `first`...
    first.cancel()  # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 0.5)


async def test_heap_of_dead_entries_stays_bounded():
    queue = AdmissionQueue(make_pool(queue_size=1_000), saturated=Gate(True))
    for _ in range(20):
        tasks = [asyncio.create_task(queue.acquire(req(), 5.0)) for _ in range(50)]
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(queue) == 0 and queue._queue.heap_size <= 32 + 50


async def test_close_fails_waiters_with_503():
    queue = AdmissionQueue(make_pool(), saturated=Gate(True))
    task = asyncio.create_task(queue.acquire(req(), 5.0))
    await asyncio.sleep(0)
    queue.close()
    with pytest.raises(NoReadyEndpoint):
        await task
    with pytest.raises(NoReadyEndpoint):
        await queue.acquire(req(), 1.0)


async def test_default_timeout_comes_from_config():
    queue = AdmissionQueue(make_pool(timeout=0.05), saturated=Gate(True))
    with pytest.raises(QueueTimeout):
        await asyncio.wait_for(queue.acquire(req()), 1.0)


async def test_next_grant_waits_until_the_granted_caller_resumes():
    """Room is judged on dispatched work: a re-check between a grant and its dispatch
    must not grant another on the same room."""
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(), saturated=gate)
    first = asyncio.create_task(queue.acquire(req(), 5.0))
    second = asyncio.create_task(queue.acquire(req(), 5.0))
    await asyncio.sleep(0)
    gate.saturated = False
    queue._release()  # grants `first`...
    queue._release()  # ...and a re-check before `first` runs grants nobody
    assert len(queue) == 1
    await asyncio.wait_for(first, 0.5)  # `first` resumed (and would dispatch now)
    queue._release()
    await asyncio.wait_for(second, 0.5)


async def test_a_release_dispatches_every_waiter_that_fits_before_any_resumes():
    """With `on_grant` (the director's pick) the release dispatches inside itself and
    judges the next waiter on that dispatch at once: room for two releases two in one
    look, in fair order, before either caller has run (bench/admission_release.py:
    without it a busy loop released ~140 waiters/s)."""
    room = [0]
    dispatched: list[int] = []
    queue = AdmissionQueue(make_pool(queue_size=8), saturated=lambda now: room[0] <= 0)

    def grant(i: int):
        def on_grant() -> None:
            dispatched.append(i)
            room[0] -= 1  # the dispatch uses the room, as the scheduler's accounting does
        return on_grant

    tasks = [asyncio.create_task(queue.acquire(req(), 5.0, on_grant=grant(i))) for i in range(3)]
    await asyncio.sleep(0)
    room[0] = 2
    queue._release()
    assert dispatched == [0, 1] and len(queue) == 1
    assert not any(t.done() for t in tasks)  # dispatched before their callers resumed
    assert await asyncio.wait_for(tasks[0], 0.5) is True
    room[0] = 1
    queue._release()
    assert dispatched == [0, 1, 2] and await asyncio.wait_for(tasks[2], 0.5) is True


async def test_a_failed_dispatch_is_that_waiters_error_and_the_next_is_released():
    gate = Gate(True)
    queue = AdmissionQueue(make_pool(), saturated=gate)
    ran: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise NoReadyEndpoint("no pod left", retry_after=1)

    failing = asyncio.create_task(queue.acquire(req(), 5.0, on_grant=broken))
    fine = asyncio.create_task(queue.acquire(req(), 5.0, on_grant=lambda: ran.append("fine")))
    await asyncio.sleep(0)
    gate.saturated = False
    queue._release()
    assert ran == ["broken", "fine"]
    with pytest.raises(NoReadyEndpoint):
        await failing
    assert await fine is True
    assert await queue.acquire(req(), 5.0, on_grant=lambda: ran.append("late")) is False
    assert ran == ["broken", "fine"]  # not held: the caller dispatches itself
