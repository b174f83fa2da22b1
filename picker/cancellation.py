"""Ending background tasks for real: cancel, and cancel again until they are done.

On Python 3.11 one `task.cancel()` is not always an end. `asyncio.wait_for`
loses a cancellation that lands in the loop iteration where its inner
operation completes (python/cpython#86296, fixed in 3.12 by rewriting
wait_for on asyncio.timeout), and the libraries under us call wait_for inside
their I/O (redis-py's `send_packed_command`, on every command). The
coordination read loop, cancelled while its registry read was opening a
connection, kept reading; the `gather` awaiting it never returned and a stop
hung (CI, 1 run in 5 here). So cancellation here is a loop: cancel what is not
done, wait a little, repeat, within a deadline; a task still running after it
is logged and left (the caller is stopping, never blocked for good).

A cancellation of the caller while it waits does not cut the cleanup short:
the tasks are still cancelled to the end (bounded), then the caller's
CancelledError is raised.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("picker.cancellation")

# Time between cancel requests: the window a swallowed one costs.
RECANCEL_INTERVAL_S = 0.05


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]], timeout_s: float) -> bool:
    """Cancel `tasks` until every one is done or `timeout_s` passed; True when all ended.
    Their results and exceptions are consumed (nothing logs "never retrieved")."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = {t for t in tasks if not t.done()}
    interrupted = False
    while pending:
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.warning("tasks still running after cancel: %s",
                        ", ".join(sorted(t.get_name() for t in pending)))
            break
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_INTERVAL_S, remaining))
        except asyncio.CancelledError:
            interrupted = True
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()
    if interrupted:
        raise asyncio.CancelledError
    return not pending
