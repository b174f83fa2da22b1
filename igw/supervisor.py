"""Runs child processes (Envoy, the picker, a simulated fleet) and keeps them up.

A child that dies is restarted with capped exponential backoff. Children are
tied to the supervisor with PR_SET_PDEATHSIG, so even a SIGKILLed supervisor
leaves no orphans. On SIGTERM/SIGINT every child gets SIGTERM in reverse start
order (Envoy first, so it stops taking requests while the picker drains), then
SIGKILL after a grace period. A child may have a `before_stop` step (Envoy's:
stop accepting connections and wait for in-flight requests to finish, bounded
by the drain timeout) that runs before its signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("igw.supervisor")

PR_SET_PDEATHSIG = 1
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
STABLE_AFTER_S = 10.0


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the supervisor goes away."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    os.setpgrp()


@dataclass
class ChildSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] | None = None
    stop_signal: signal.Signals = signal.SIGTERM
    stop_timeout_s: float = 35.0
    # Called before every (re)start, e.g. to re-render a config file.
    before_start: Callable[[], None] | None = None
    # Awaited before the stop signal on shutdown (not on crash restarts), e.g. a drain.
    before_stop: Callable[[], Awaitable[None]] | None = None
    # True: the child's stdout goes to our stderr, keeping our stdout for what a caller
    # reads (the URL line first, then Envoy's access log).
    stdout_to_stderr: bool = False


@dataclass
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    backoff_s: float = BACKOFF_START_S
    exits: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    """Starts children in order, restarts the ones that die, stops them all cleanly."""

    def __init__(self, specs: Sequence[ChildSpec]) -> None:
        self.children = [Child(spec) for spec in specs]
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.spec.name == name)

    async def start(self) -> None:
        for child in self.children:
            await self._spawn(child)
            self._watchers.append(asyncio.create_task(self._watch(child)))

    async def _spawn(self, child: Child) -> None:
        if child.spec.before_start is not None:
            child.spec.before_start()
        env = {**os.environ, **(child.spec.env or {})}
        child.proc = await asyncio.create_subprocess_exec(
            *child.spec.argv,
            env=env,
            preexec_fn=_die_with_parent,
            stdout=sys.stderr if child.spec.stdout_to_stderr else None,
        )
        child.started_at = time.monotonic()
        log.info("started %s pid=%d", child.spec.name, child.proc.pid)

    async def _watch(self, child: Child) -> None:
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            child.exits.append(code)
            if self._stopping:
                return
            if time.monotonic() - child.started_at > STABLE_AFTER_S:
                child.backoff_s = BACKOFF_START_S
            log.warning(
                "%s exited code=%d; restarting in %.1fs", child.spec.name, code, child.backoff_s
            )
            await asyncio.sleep(child.backoff_s)
            if self._stopping:
                return
            child.backoff_s = min(max(child.backoff_s, BACKOFF_START_S) * 2, BACKOFF_MAX_S)
            child.restarts += 1
            await self._respawn(child)

    async def _respawn(self, child: Child) -> None:
        """Start the child again; a start that fails (before_start, exec) is retried with
        backoff instead of ending this watcher (which would leave the child down for good)."""
        while not self._stopping:
            try:
                await self._spawn(child)
                return
            except Exception:
                log.exception(
                    "%s: restart failed; retrying in %.1fs", child.spec.name, child.backoff_s
                )
            await asyncio.sleep(child.backoff_s)
            child.backoff_s = min(max(child.backoff_s, BACKOFF_START_S) * 2, BACKOFF_MAX_S)

    async def restart(self, name: str) -> None:
        """Stop one child; its watcher starts it again (used for config changes)."""
        child = self.child(name)
        child.backoff_s = 0.0
        await _terminate(child)

    async def stop(self) -> None:
        self._stopping = True
        for child in reversed(self.children):
            await _drain(child)
            await _terminate(child)
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    def exit_codes(self) -> dict[str, int | None]:
        return {c.spec.name: (c.proc.returncode if c.proc else None) for c in self.children}


async def _drain(child: Child) -> None:
    """Run the child's `before_stop` (a bounded drain); a failure only skips the drain."""
    proc = child.proc
    if child.spec.before_stop is None or proc is None or proc.returncode is not None:
        return
    try:
        await child.spec.before_stop()
    except Exception:  # the stop itself must go on
        log.exception("%s: drain failed; stopping it now", child.spec.name)


async def _terminate(child: Child) -> None:
    proc = child.proc
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(child.spec.stop_signal)
    try:
        await asyncio.wait_for(proc.wait(), child.spec.stop_timeout_s)
    except TimeoutError:
        log.warning("%s did not stop in %.0fs; killing", child.spec.name, child.spec.stop_timeout_s)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


async def run_until_signalled(
    supervisor: Supervisor, on_ready: Callable[[], Awaitable[None]] | None = None
) -> int:
    """Start, call `on_ready`, wait for SIGTERM/SIGINT, stop. Returns the exit code."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await supervisor.start()
    try:
        if on_ready is not None:
            ready = asyncio.create_task(on_ready())
            waiter = asyncio.create_task(done.wait())
            await asyncio.wait({ready, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not ready.done():
                ready.cancel()
                return 0
            if ready.exception() is not None:
                log.error("not ready: %s", ready.exception())
                return 1
        await done.wait()
        return 0
    finally:
        await supervisor.stop()
