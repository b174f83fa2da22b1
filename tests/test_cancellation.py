"""cancel_and_wait: tasks end even when a cancellation is lost (Python 3.11's
wait_for race, python/cpython#86296), the caller's own cancellation is kept,
and a task that never ends costs the deadline, not a hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from picker.cancellation import cancel_and_wait


async def _swallows_first_cancel(loops: list[int]) -> None:
    """What a loop looks like when wait_for lost its cancellation: it goes on."""
    swallowed = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
        loops[0] += 1


async def test_a_task_that_loses_one_cancel_still_ends():
    loops = [0]
    task = asyncio.create_task(_swallows_first_cancel(loops))
    await asyncio.sleep(0.03)
    assert await cancel_and_wait([task], timeout_s=2.0)
    assert task.cancelled()
    # a single cancel is what did not suffice: the same task survives one
    other = asyncio.create_task(_swallows_first_cancel(loops))
    await asyncio.sleep(0.03)
    other.cancel()
    before = loops[0]
    await asyncio.sleep(0.05)
    assert not other.done() and loops[0] > before
    assert await cancel_and_wait([other], timeout_s=2.0)


async def test_a_task_that_never_ends_costs_the_deadline_and_is_reported(caplog):
    stubborn = True

    async def ignores_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if not stubborn:
                    raise

    task = asyncio.create_task(ignores_cancel(), name="stubborn-loop")
    await asyncio.sleep(0.02)  # inside its loop (a task cancelled before its first step just ends)
    start = time.monotonic()
    assert not await cancel_and_wait([task], timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert "stubborn-loop" in caplog.text
    stubborn = False
    assert await cancel_and_wait([task], timeout_s=2.0)


async def test_the_callers_cancellation_is_raised_after_the_tasks_ended():
    loops = [0]
    child = asyncio.create_task(_swallows_first_cancel(loops))

    async def owner() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await cancel_and_wait([child], timeout_s=2.0)

    parent = asyncio.create_task(owner())
    await asyncio.sleep(0.02)
    parent.cancel()
    await asyncio.sleep(0.02)
    parent.cancel()  # a second cancel lands during the cleanup
    with pytest.raises(asyncio.CancelledError):
        await parent
    assert child.done()


async def test_exceptions_of_ended_tasks_are_consumed():
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], timeout_s=1.0)
    assert task._log_traceback is False  # retrieved: no "exception never retrieved"
