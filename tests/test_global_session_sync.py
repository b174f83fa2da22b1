"""Session bindings shared between global-router replicas (globalrouter.session_sync)
through a real redis-server: a binding made on one replica reaches the other, a replica
that starts late reads the live ones, and Redis killed and restarted under it loses no
request-path call and resumes. The wire format's edge cases as units."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from contract.config import CoordinationConfig
from contract.global_config import AffinityConfig
from globalrouter.affinity import RegionAffinity
from globalrouter.session_sync import SessionSync, decode, encode
from picker.coordination.bus import redis_client
from tests.test_coordination_support import redis_server

NAMES = ("us-east-1", "us-west-2", "eu-west-1")


def _replica(url: str, prefix: str, name: str) -> SessionSync:
    settings = CoordinationConfig(url=url, timeout_s=0.5)
    return SessionSync(RegionAffinity(AffinityConfig(), len(NAMES)), NAMES,
                       lambda: redis_client(settings, None, 0.5, 1), prefix, name)


async def _until(check, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def _bind(sync: SessionSync, session: str, row: int) -> None:
    """What the director does for one placed request."""
    if sync.affinity.record(session, [], row, time.monotonic()):
        sync.record(session, row)


def test_bindings_reach_the_other_replicas_and_a_late_one():
    with redis_server() as redis:
        async def run() -> dict:
            prefix = f"igw-global-test-{time.monotonic_ns()}"
            a, b = _replica(redis.url, prefix, "a"), _replica(redis.url, prefix, "b")
            await a.start()
            await b.start()
            try:
                _bind(a, "conv-1", 2)
                seen = await _until(lambda: b.affinity.session_row("conv-1", time.monotonic())
                                    == 2, 2.0, "b to learn conv-1")
                _bind(b, "conv-1", 0)  # moved on b: a follows
                await _until(lambda: a.affinity.session_row("conv-1", time.monotonic()) == 0,
                             2.0, "a to follow the move")
                _bind(a, "conv-2", 1)
                await _until(lambda: a.stats()["pending"] == 0, 2.0, "a to publish")
                late = _replica(redis.url, prefix, "c")
                await late.start()
                try:
                    await _until(lambda: late.affinity.session_row("conv-2", time.monotonic())
                                 == 1, 2.0, "the late replica to warm up")
                    assert late.affinity.session_row("conv-1", time.monotonic()) == 0
                finally:
                    await late.stop()
                return {"seen_s": seen, "a": a.stats(), "b": b.stats()}
            finally:
                await a.stop()
                await b.stop()

        figures = asyncio.run(run())
    assert figures["seen_s"] < 1.0, figures
    assert figures["a"]["errors"] == 0 and figures["b"]["adopted"] >= 1


def test_redis_killed_and_back_costs_the_request_path_nothing():
    with redis_server() as redis:
        async def run() -> tuple[float, dict]:
            prefix = f"igw-global-test-{time.monotonic_ns()}"
            a, b = _replica(redis.url, prefix, "a"), _replica(redis.url, prefix, "b")
            await a.start()
            await b.start()
            try:
                await _until(lambda: a.connected and b.connected, 3.0, "both connected")
                os.kill(redis.child.pid, signal.SIGKILL)
                redis.stop()
                started = time.perf_counter()
                for i in range(1000):  # the request path while Redis is gone
                    _bind(a, f"down-{i}", i % 3)
                spent = time.perf_counter() - started
                await _until(lambda: not a.connected, 5.0, "a to see Redis down")
                assert a.affinity.session_row("down-7", time.monotonic()) == 1  # local holds
                redis.start()  # same port
                await _until(lambda: a.connected and b.connected, 10.0, "reconnected")
                _bind(a, "after", 2)
                await _until(lambda: b.affinity.session_row("after", time.monotonic()) == 2,
                             3.0, "b to learn a binding made after the restart")
                return spent, a.stats()
            finally:
                await a.stop()
                await b.stop()

        spent, stats = asyncio.run(run())
    assert stats["errors"] >= 1
    assert spent < 0.5  # 1,000 bindings with Redis dead: appends, no waiting on it


def test_the_wire_format_skips_what_is_not_a_binding():
    blob = encode([("conv-1", "us-east-1"), ("conv 2", "eu-west-1")])
    assert decode(blob) == [("conv-1", "us-east-1"), ("conv 2", "eu-west-1")]
    assert decode(b"no-tab\n\tregion\nsession\t\n" + blob) == decode(blob)
    affinity = RegionAffinity(AffinityConfig(), 3)
    affinity.adopt("x" * 300, 1, 0.0)  # longer than a client could send: ignored
    assert affinity.sessions == 0


def test_a_binding_is_news_when_new_moved_or_due_for_a_refresh():
    affinity = RegionAffinity(AffinityConfig(session_idle_timeout_s=60), 3)
    assert affinity.record("s", [], 1, 0.0)
    assert not affinity.record("s", [], 1, 10.0)
    assert affinity.record("s", [], 2, 11.0)  # moved
    assert not affinity.record("s", [], 2, 40.0)
    assert affinity.record("s", [], 2, 42.0)  # half the idle timeout since it was told
    assert not affinity.record(None, [], 2, 43.0)
