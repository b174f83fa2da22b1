"""A stand-in pod for tests that are not async: its own event loop in a thread.

A live test that runs the gateway as a child process blocks while it waits for
the gateway's lines, so the pod the gateway scrapes must answer from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from simulator.standin import StandInPod

START_TIMEOUT_S = 10.0
T = TypeVar("T")


@contextlib.contextmanager
def loop_thread(name: str) -> Iterator[Callable[[Coroutine[Any, Any, T]], T]]:
    """An event loop in a daemon thread; yields `run(coro)`, which waits for the result.
    The loop is stopped and closed when the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(START_TIMEOUT_S)

    try:
        yield run
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_TIMEOUT_S)
        loop.close()


@contextlib.contextmanager
def standin_pod(engine: str, body: bytes) -> Iterator[str]:
    """Serve `body` as the pod's `/metrics` on a free loopback port; yields `host:port`."""
    pod = StandInPod(engine, static_body=body)
    with loop_thread("standin-pod") as run:
        address = run(pod.start())
        try:
            yield address
        finally:
            run(pod.stop())
