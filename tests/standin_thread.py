"""A stand-in pod for tests that are not async: its own event loop in a thread.

A live test that runs the gateway as a child process blocks while it waits for
the gateway's lines, so the pod the gateway scrapes must answer from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from simulator.standin import StandInPod

START_TIMEOUT_S = 10.0


@contextlib.contextmanager
def standin_pod(engine: str, body: bytes) -> Iterator[str]:
    """Serve `body` as the pod's `/metrics` on a free loopback port; yields `host:port`."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="standin-pod", daemon=True)
    thread.start()
    pod = StandInPod(engine, static_body=body)
    try:
        address = asyncio.run_coroutine_threadsafe(pod.start(), loop).result(START_TIMEOUT_S)
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(pod.stop(), loop).result(START_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_TIMEOUT_S)
        loop.close()
