"""Batch slots and tenants' fair shares of them: unit tests (no processes).

- PoolState.slot_limits learns a pod's slots from its scrapes (running while
  requests wait with KV to spare, across an engine step), never from a KV-bound queue,
  one within a step (a token-budget wait) or one that may wait for an adapter slot, and
  raises an underestimate; flow control bounds the pool's
  requests by its slots + slotAllowance per pod (which pod stays the scorers' choice); unknown slots
  leave today's behaviour; the pick prefers a free slot only while tenants
  share the slots.
- TenantShares: a tenant alone is not limited; active tenants split the slots
  by weight (at least one each); an idle tenant stops counting after the window;
  state stays bounded.
- FairQueue.peek_excluding / take: the next in fair order among tenants not
  skipped, advancing the band's clock like pop.
- Admission: a tenant at its share queues while slots are free; a quiet
  tenant's newcomer is released at once past the noisy tenant's waiters (and
  is not with the shares off: the test can fail).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from picker.scheduling import AdmissionQueue, Scheduler
from picker.scheduling.fair_queue import FairQueue
from picker.scheduling.flow import (
    committed,
    free_slots,
    has_room,
    pod_room,
    pool_slots,
    shared_slots,
    slots_room,
    tenant_capped,
)
from picker.scheduling.shares import PRUNE_INTERVAL_S, TenantShares
from tests.test_scheduling_flow import NOW, make_pool, req

ROWS = np.arange(2)


def scrape(pool, row: int, running: float, waiting: float, kv: float = 0.1,
           steps: float = 1.0) -> None:
    """A new scrape of `row` (a later `scraped_at`) showing these figures, the engine
    `steps` further on (its step counter: iterations, or tokens generated)."""
    t = pool.table
    t.running[row], t.waiting[row], t.kv_usage[row] = running, waiting, kv
    t.engine_steps[row] += steps
    t.scraped_at[row] += 0.05


def slotted(slots: int = 4, window: float = 5.0, allowance: int = 1):
    """Two pods whose last scrapes showed `slots` running and a queue: slots learned."""
    pool = make_pool(2)
    pool.config = replace(pool.config, saturation=replace(
        pool.config.saturation, fair_share_window_s=window, slot_allowance=allowance))
    sched = Scheduler(pool)
    for _ in range(2):  # two scrapes in a row show the queue
        for row in (0, 1):
            scrape(pool, row, slots, 2)
        sched.state.slot_limits(ROWS)
    assert sched.state.slot_limits(ROWS).tolist() == [slots, slots]
    return pool, sched


# -- learning the slots ----------------------------------------------------------------------


def test_slots_are_learned_from_a_steady_queue_with_kv_to_spare_only():
    pool = make_pool(2)
    sched = Scheduler(pool)
    state = sched.state

    def both(r0, w0, r1, w1, kv1=0.1):
        scrape(pool, 0, r0, w0)
        scrape(pool, 1, r1, w1, kv=kv1)
        return state.slot_limits(ROWS).tolist()

    assert both(3, 0, 2, 5, kv1=0.95) == [0, 0]  # no queue; a queue for memory
    assert both(3, 0, 2, 5, kv1=0.95) == [0, 0]
    assert both(2, 3, 0, 0) == [0, 0]  # a burst: arrivals wait a step...
    assert both(5, 2, 0, 0) == [0, 0]  # ...while running climbs: not a limit yet
    assert state.slot_limits(ROWS).tolist() == [0, 0]  # the same scrape again: no news
    assert both(5, 1, 0, 0) == [5, 0]  # two scrapes in a row, a queue, same running
    assert pool_slots(state, ROWS) == 0.0  # any unknown: the pool's slots are unknown
    assert both(6, 0, 8, 1) == [6, 0]  # once known, any higher running raises it
    assert both(1, 0, 8, 2) == [6, 8]  # a quiet scrape never lowers it
    assert pool_slots(state, ROWS) == 14.0


def test_a_queue_within_one_engine_step_teaches_no_slots():
    """Two scrapes inside one long step (a prefill of a full token budget) both show its
    queue and the same `running`: the queue waits for the next step's budget, not for a
    slot, so nothing is learned until a step passed between two such scrapes. A page
    without a step counter (NaN) learns as before."""
    pool = make_pool(2)
    sched = Scheduler(pool)
    state = sched.state
    for _ in range(4):
        for row in (0, 1):
            scrape(pool, row, 14, 3, steps=0.0)
        assert state.slot_limits(ROWS).tolist() == [0, 0]
    scrape(pool, 0, 14, 3)  # a step later the queue is still there, 14 still run: a limit
    scrape(pool, 1, 14, 3, steps=0.0)
    assert state.slot_limits(ROWS).tolist() == [14, 0]
    pool.table.engine_steps[1] = np.nan  # no counter on the page: two scrapes suffice
    scrape(pool, 1, 14, 3)
    assert state.slot_limits(ROWS).tolist() == [14, 14]


def test_a_queue_that_may_wait_for_an_adapter_slot_teaches_no_batch_slots():
    """With adapters configured, a queue holding an adapter that is not running (it waits
    for an adapter slot, not a batch slot), or on a page that says nothing of adapters
    (max_lora unknown), is no slot limit; a queue of running adapters' requests is."""
    pool = make_pool(2)
    pool.config = replace(pool.config, lora_adapters=("a", "b"))
    pool.adapter_index.update({"a": 0, "b": 1})
    sched = Scheduler(pool)
    state, t = sched.state, pool.table
    t.max_lora[:2] = [1, 0]  # pod 1's page has no LoRA information
    t.lora_running[0, 0] = True
    t.lora_waiting[0, 1] = True  # pod 0: "b" waits for pod 0's one adapter slot
    for _ in range(3):
        for row in (0, 1):
            scrape(pool, row, 3, 2)
        assert state.slot_limits(ROWS).tolist() == [0, 0]
    t.lora_waiting[0, 1] = False
    t.lora_waiting[0, 0] = True  # now only "a", which runs, waits: a batch limit
    for _ in range(2):
        for row in (0, 1):
            scrape(pool, row, 3, 2)
        state.slot_limits(ROWS)
    assert state.slot_limits(ROWS).tolist() == [3, 0]


def test_the_pool_takes_its_slots_plus_the_allowance_and_unknown_slots_change_nothing():
    pool, sched = slotted(4)
    small = req(100)  # far inside the start-delay bound: only slots limit here
    for _ in range(9):
        sched.on_dispatch(0, small, NOW)  # where is the scorers' choice: the pool counts
    assert slots_room(sched.state, ROWS) and has_room(sched.state, small, NOW)
    assert pod_room(sched.state, small, NOW, ROWS).tolist() == [True, True]  # no pod bound
    sched.on_dispatch(1, small, NOW)  # 10 = 2 x (4 slots + allowance 1)
    assert not slots_room(sched.state, ROWS) and not has_room(sched.state, small, NOW)
    assert committed(sched.state, NOW).saturation == pytest.approx(10 / 8)
    sched.on_complete(1, small, NOW, 0.5, True)
    assert has_room(sched.state, small, NOW)
    # one pod's slots unknown: only the start-delay bound applies (ten small requests fit)
    scrape(pool, 0, 0, 0)
    sched.state.slots[0] = 0.0
    for _ in range(10):
        sched.on_dispatch(1, small, NOW)
    assert slots_room(sched.state, ROWS) and has_room(sched.state, small, NOW)
    # flow control off turns the slots off too
    pool, sched = slotted(4)
    pool.config = replace(pool.config, saturation=replace(
        pool.config.saturation, max_start_delay_s=0.0))
    for _ in range(20):
        sched.on_dispatch(0, small, NOW)
    assert has_room(sched.state, small, NOW)


def a_holds_pod_0():
    """Slots 4 + 4 learned; tenant a (active) has 4 requests in flight on pod 0."""
    pool, sched = slotted(4)
    for _ in range(4):
        sched.state.on_dispatch(0, req(100, tenant="a"), NOW)
    sched.state.shares.seen("a", 1.0, NOW, 5.0)
    return pool, sched, sched.state


def test_free_slots_are_preferred_only_while_tenants_share_the_slots():
    pool, sched, state = a_holds_pod_0()
    assert free_slots(state, req(100, tenant="a"), NOW, ROWS) is None  # a alone: scorers
    state.shares.seen("b", 1.0, NOW, 5.0)
    assert free_slots(state, req(100, tenant="b"), NOW, ROWS).tolist() == [False, True]
    ctx = sched._filter(req(100, tenant="b"), NOW)[0]
    assert ctx.rows.tolist() == [1]  # the flow-room filter keeps the pod with a free slot
    assert sched.pick(req(100, tenant="b"), NOW).rows[0] == 1
    pool.config = replace(pool.config, saturation=replace(
        pool.config.saturation, fair_share_window_s=0.0))
    assert free_slots(state, req(100, tenant="b"), NOW, ROWS) is None  # shares off


# -- shares ----------------------------------------------------------------------------------


def test_a_tenant_alone_uses_everything_and_active_tenants_split_by_weight():
    s = TenantShares()
    s.seen("a", 1.0, NOW, 5.0)
    assert s.share("a", 8, NOW, 5.0) is None
    for _ in range(8):
        s.dispatched("a")
    assert not s.capped("a", 8, NOW, 5.0)
    s.seen("b", 1.0, NOW + 1, 5.0)
    assert s.share("a", 8, NOW + 1, 5.0) == s.share("b", 8, NOW + 1, 5.0) == 4.0
    assert s.capped("a", 8, NOW + 1, 5.0) and not s.capped("b", 8, NOW + 1, 5.0)
    s.seen("b", 3.0, NOW + 1, 5.0)  # weights
    assert s.share("b", 8, NOW + 1, 5.0) == 6.0 and s.share("a", 8, NOW + 1, 5.0) == 2.0
    assert s.share("a", 1, NOW + 1, 5.0) == 1.0  # at least one slot each
    # b idle past the window (nothing in flight): a is alone again
    assert s.share("a", 8, NOW + 7, 5.0) is None
    # ...but a tenant with a request in flight stays active
    s.dispatched("b")
    assert s.share("a", 8, NOW + 7, 5.0) == 2.0
    s.completed("b")
    s.completed("b")  # more completions than dispatches: never negative
    assert s.inflight("b") == 0
    assert s.share("a", 8, NOW, 0.0) is None and s.share("a", 0, NOW, 5.0) is None  # off


def test_idle_tenants_are_dropped():
    s = TenantShares()
    for i in range(1_000):
        s.seen(f"t{i}", 1.0, NOW + i * 0.01, 1.0)
    assert len(s) <= 300
    s.dispatched("t999")
    s.seen("x", 1.0, NOW + 100, 1.0)
    s.seen("x", 1.0, NOW + 100 + PRUNE_INTERVAL_S, 1.0)
    assert len(s) == 2  # x, and t999 (in flight)


# -- the queue's order with tenants skipped --------------------------------------------------


def test_peek_excluding_takes_the_next_in_fair_order_among_the_others():
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push(f"n{i}", 0, "noisy")
    q.push("q0", 0, "quiet")
    q.push("q1", 0, "quiet")
    q.push("hi", 5, "noisy")
    assert q.peek().item == "hi"
    assert q.peek_excluding({"noisy"}).item == "q0"  # bands first, then fair order
    assert q.take(q.peek_excluding({"noisy"})) == "q0"
    assert q.peek_excluding({"quiet", "noisy"}) is None
    assert q.tenants() == {"noisy", "quiet"}
    assert [q.pop() for _ in range(len(q))] == ["hi", "n0", "n1", "q1", "n2", "n3", "n4"]
    for i in range(3_000):  # take churn leaves the heap bounded
        q.push(f"x{i}", 0, "x")
        q.push(f"y{i}", 0, "y")
        q.take(q.peek_excluding({"x"}))
    assert q.heap_size <= 2 * len(q) + 32 + 1 and len(q) == 3_000


# -- admission -------------------------------------------------------------------------------


async def _run(window: float) -> tuple[bool, int]:
    """Noisy holds 4 of 8 slots and has waiters; does a quiet newcomer start at once?
    Returns (quiet released within a few loop passes, noisy requests dispatched)."""
    pool, sched = slotted(4, window=window)
    queue = AdmissionQueue(pool, sched, clock=lambda: NOW)
    quiet = req(100, tenant="quiet")
    queue.blocked(quiet, NOW)  # the quiet tenant is active (sent one a moment ago)
    noisy_sent = 0

    async def noisy() -> None:
        nonlocal noisy_sent
        r = req(100, tenant="noisy")
        await queue.acquire(r, 1.0)
        sched.on_dispatch(sched.pick(r, NOW).rows[0], r, NOW)
        noisy_sent += 1

    hog = [asyncio.create_task(noisy()) for _ in range(30)]
    for _ in range(50):
        await asyncio.sleep(0)
    quiet_task = asyncio.create_task(queue.acquire(quiet, 1.0))
    for _ in range(5):
        await asyncio.sleep(0)
    released = quiet_task.done() and quiet_task.exception() is None
    for task in (*hog, quiet_task):
        task.cancel()
    await asyncio.gather(*hog, quiet_task, return_exceptions=True)
    return released, noisy_sent


async def test_a_tenant_within_its_share_starts_past_the_noisy_ones_waiters():
    released, noisy_sent = await _run(window=5.0)
    assert noisy_sent == 4 and released  # noisy stops at its share; quiet finds a slot
    released, noisy_sent = await _run(window=0.0)  # shares off: noisy takes every slot
    assert noisy_sent == 10 and not released


def test_tenant_capped_needs_two_tenants_and_known_slots():
    pool, _, state = a_holds_pod_0()
    assert shared_slots(state, NOW) == 0.0  # a alone
    state.shares.seen("b", 1.0, NOW, 5.0)
    slots = shared_slots(state, NOW)
    assert slots == 8.0
    assert tenant_capped(state, "a", NOW, slots) and not tenant_capped(state, "b", NOW, slots)
    pool.table.ready[1] = False  # one pod left: a's share is 2 of its 4 slots
    state.on_complete(0, req(100, tenant="a"), NOW, 0.5, True)
    assert shared_slots(state, NOW) == 4.0 and tenant_capped(state, "a", NOW, 4.0)
    state.slots[0] = 0.0  # slots unknown: no shares
    scrape(pool, 0, 0, 0)
    assert shared_slots(state, NOW) == 0.0 and not tenant_capped(state, "a", NOW, 0.0)
