"""Helpers of the coordination tests: a real redis-server, and routing without servers.

`redis_server` starts Debian's /usr/bin/redis-server on a free loopback port
(no persistence), through bench/procs.py, and stops it by PID. `limited_load` and
`assert_shared_limit` serve the tests that load one shared tenant limit through
several real gateways or routers. `Replica` is
one gateway replica without its servers: a Datastore, a Director and a
Coordinator on a shared config, so a test can route on it and look at its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from bench.procs import Child, start_piped, wait_line
from contract.config import GatewayConfig, parse_config
from igw.ports import free_port
from igw_envoy.tls import TlsFiles
from picker.coordination import Coordinator
from picker.datastore import Datastore
from picker.director import Decision, Director, RequestInfo
from picker.gateway_metrics import GatewayMetrics
from tests.test_reliability_support import Figures, Load, LoadResult

REDIS_SERVER = "/usr/bin/redis-server"
POOL = "llama"
MODEL = "llama-3.1-8b"
PODS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


@dataclass
class RedisServer:
    port: int
    child: Child | None = None
    starts: int = 0
    # TLS on the port (the server's pair; clients are not asked for certificates)
    tls: TlsFiles | None = None
    # more configuration, e.g. ACL users: ("--user", "alice", "on", ">pw", "~*", "+@all")
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        port = ["--port", str(self.port)]
        if self.tls is not None:
            port = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                    "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
        child = start_piped(
            "redis-server",
            [REDIS_SERVER, *port, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
             *self.extra_args],
        )
        wait_line(child, lambda line: "Ready to accept connections" in line, 15)
        child.drain()
        self.child = child
        self.starts += 1

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(timeout=5)
            self.child = None


@contextlib.contextmanager
def redis_server(*extra_args: str, tls: TlsFiles | None = None) -> Iterator[RedisServer]:
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    server = RedisServer(free_port(), tls=tls, extra_args=extra_args)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def config_doc(url: str | None, **coordination: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulers": [
            {"name": POOL, "modelName": MODEL, "endpoints": list(PODS),
             "loraAdapters": ["sql-lora"], "routeTimeout": "30s"}
        ],
    }
    if url is not None:
        spec["coordination"] = {
            "url": url, "keyPrefix": f"igw-test-{time.monotonic_ns()}",
            "heartbeatInterval": "200ms", "replicaTimeout": "1s", **coordination,
        }
    return {"apiVersion": "inference-gateway.io/v1alpha1", "kind": "InferenceGatewayConfig",
            "metadata": {"name": "test"}, "spec": spec}


@dataclass
class Replica:
    """One replica's routing parts; `coordinator.start()` is the test's to call."""

    config: GatewayConfig
    datastore: Datastore
    director: Director
    coordinator: Coordinator
    decisions: list[Decision] = field(default_factory=list)

    @classmethod
    def make(cls, config: GatewayConfig, name: str) -> Replica:
        datastore = Datastore(config)
        for pool in datastore.pools.values():  # every pod looks freshly scraped and idle
            for pod in pool.pods.values():
                pool.mark_scrape(pod.row, True)
        director = Director(datastore, GatewayMetrics())
        return cls(config, datastore, director, Coordinator(config, director, replica=name))

    @property
    def pool(self):
        return self.datastore.pools[POOL]

    @property
    def state(self):
        return self.director.schedulers[POOL].state

    def route(self, prompt: str, model: str = MODEL, max_tokens: int = 64) -> Decision:
        body = orjson.dumps({"model": model, "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": prompt}]})
        decision = self.director.route_now(body, RequestInfo(path="/v1/chat/completions",
                                                             content_type="application/json"))
        assert decision.dispatched
        self.decisions.append(decision)
        return decision

    def complete_all(self) -> None:
        for decision in self.decisions:
            decision.status = 200
            self.director.complete(decision)
        self.decisions.clear()

    def inflight(self) -> float:
        return float(self.pool.table.inflight.sum())

    def row(self, address: str) -> int:
        return self.pool.pods[address].row

    def keep_fresh(self) -> None:
        for pod in self.pool.pods.values():
            self.pool.mark_scrape(pod.row, True)


async def eventually(check: Callable[[], bool], timeout: float, step: float = 0.01) -> float:
    """Seconds until `check()` holds; fails the test after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true within {timeout}s: {check}")
        await asyncio.sleep(step)
    return time.monotonic() - start


def long_prompt(seed: str, chars: int = 2000) -> str:
    words = " ".join(f"{seed}{i}" for i in range(chars))
    return words[:chars]


def pair_config(url: str, **coordination: Any) -> GatewayConfig:
    return parse_config(config_doc(url, **coordination))



# The shared limiter's windows: minutes on Redis TIME, this machine's wall clock here.
LIMIT_WINDOW_S = 60.0


def limited_body(i: int) -> bytes:
    """The i-th small chat request of a tenant-limit load."""
    return orjson.dumps({"model": MODEL, "max_tokens": 4,
                         "messages": [{"role": "user", "content": f"question {i}"}]})


def limited_load(targets: list[Any], key: str, rate: float, duration: float
                 ) -> list[LoadResult]:
    """Open-loop load of one tenant's requests (API key `key`) through every target (a
    gateway or router: `.url`, `.ca`) at once, `rate` requests/s each, inside one minute
    window (it waits for one with time enough left), so the whole run may admit exactly
    the limit."""
    left = LIMIT_WINDOW_S - time.time() % LIMIT_WINDOW_S
    if left < duration + 8:
        time.sleep(left + 0.5)
    window = int(time.time() // LIMIT_WINDOW_S)
    loads = [Load(t.url, t.ca, rate=rate, duration=duration, body=limited_body,
                  headers={"authorization": f"Bearer {key}"}, timeout=20).in_thread()
             for t in targets]
    results = [f.result(timeout=duration + 60) for f in loads]
    assert int(time.time() // LIMIT_WINDOW_S) == window, "the run left its window"
    return results


def assert_shared_limit(results: list[LoadResult], limit: int, name: str, per: str,
                        overload: int = 3) -> Figures:
    """Every answer a 200 or a 429 with Retry-After, the load well over the limit, the
    200s over all targets the limit within ±5 %, each target admitting part of it (one
    limit, not one each). The figures, for the caller to add to and emit."""
    statuses = [r.statuses() for r in results]
    admitted = sum(s[200] for s in statuses)
    assert all(set(s) <= {200, 429} for s in statuses), [r.summary() for r in results]
    # the load really was over the limit: more than `overload` times it refused
    assert sum(s[429] for s in statuses) > overload * limit
    assert abs(admitted - limit) <= 0.05 * limit, (admitted, [r.summary() for r in results])
    refused = [o for r in results for o in r.outcomes if o.status == 429]
    assert all(o.retry_after and int(o.retry_after) >= 1 for o in refused)
    assert all(s[200] > 0 for s in statuses), statuses
    fig = Figures(name)
    fig["limit_per_minute"] = limit
    fig["offered"] = sum(len(r.outcomes) for r in results)
    fig["admitted"] = admitted
    fig[f"admitted_per_{per}"] = [s[200] for s in statuses]
    fig["error_vs_limit_pct"] = round(100 * (admitted - limit) / limit, 2)
    return fig
