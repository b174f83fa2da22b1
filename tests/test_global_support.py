"""Shared pieces of the global router's live suites (no tests here): three regions, the
global tier in front of them, optional delay proxies between the two, a partition.

Each region is a real Tier-1 gateway (`igw serve`) on its own loopback address
(127.0.0.2-4) in front of simulated pods (one simulator process holds the three
regions' pods, named after their region); the global tier is the real router process
behind its real Envoy, reaching the regions over TLS with each region's own CA. With
`rtts`, each region is reached through an igw.delay_proxy.DelayProxy on its address
(run here, in a thread, so a test can change a region's RTT while traffic flows). A
partition is the kernel's: iptables drops every packet to and from one region's port
(established connections hang, new connects get no SYN-ACK); it needs root and the
iptables command, and the tests using it skip without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from contract import headers as hdr
from igw.delay_proxy import DelayProxy
from igw.ports import free_port
from tests.procs import Gateway, GlobalRouter, gateway, gateway_config, global_config, sim_fleet
from tests.procs import global_router as start_global_router

LLAMA = "llama-3.1-8b"
# name, loopback address, GPU of its pods, price per million tokens, residency
REGIONS = (
    ("us-east-1", "127.0.0.2", "h100", 0.30, "us"),
    ("us-west-2", "127.0.0.3", "a100", 0.18, "us"),
    ("eu-west-1", "127.0.0.4", "a10g", 0.10, "eu"),
)
RETRIES = "cluster.regions.upstream_rq_retry"
BODY = {"model": LLAMA, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _pods() -> list[dict]:
    return [
        {"name": f"{name}-{i}", "gpu": gpu, "model": LLAMA, "engine": "vllm"}
        for name, _, gpu, _, _ in REGIONS
        for i in range(2)
    ]


def _tier1_config(fleet, name: str, address: str) -> dict:
    endpoints = [fleet.address(f"{name}-{i}") for i in range(2)]
    config = gateway_config([{"name": "llama", "modelName": LLAMA, "endpoints": endpoints}])
    config["metadata"]["name"] = name
    config["spec"]["listener"]["address"] = address
    return config


def region_of(pod: str) -> str:
    """The region a simulated pod belongs to (`eu-west-1-0` → `eu-west-1`)."""
    return pod.rpartition("-")[0]


class ProxyLoop:
    """Delay proxies on an event loop of their own thread; `set_rtt` from the test's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: dict[str, DelayProxy] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def add(self, name: str, listen: tuple[str, int], upstream: tuple[str, int],
            rtt_s: float) -> DelayProxy:
        proxy = DelayProxy(listen, upstream, rtt_s)
        asyncio.run_coroutine_threadsafe(proxy.start(), self.loop).result(10)
        self.proxies[name] = proxy
        return proxy

    def set_rtt(self, name: str, rtt_s: float) -> None:
        self.loop.call_soon_threadsafe(self.proxies[name].set_rtt, rtt_s)

    def close(self) -> None:
        for proxy in self.proxies.values():
            asyncio.run_coroutine_threadsafe(proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class World:
    """The running regions and global tier; `endpoints` are what the router reaches."""

    router: GlobalRouter
    tier1: dict[str, Gateway]
    configs: dict[str, dict]
    tmp: Path
    endpoints: dict[str, tuple[str, int]] = field(default_factory=dict)
    proxies: ProxyLoop | None = None


@contextlib.contextmanager
def global_world(tmp: Path, *, slo: str = "10s", rtts: dict[str, float] | None = None,
                 polling: dict | None = None) -> Iterator[World]:
    """Three regions (REGIONS) and the global router, every region fresh."""
    with sim_fleet(tmp, _pods(), time_scale=10.0) as fleet, contextlib.ExitStack() as stack:
        tier1, configs, endpoints = {}, {}, {}
        proxies = None
        if rtts is not None:
            proxies = ProxyLoop()
            stack.callback(proxies.close)
        for name, address, _, _, _ in REGIONS:
            configs[name] = _tier1_config(fleet, name, address)
            tier1[name] = stack.enter_context(gateway(tmp, configs[name]))
            endpoints[name] = (address, configs[name]["spec"]["listener"]["port"])
            if proxies is not None and rtts is not None:
                front = (address, free_port(address))
                proxies.add(name, front, endpoints[name], rtts.get(name, 0.0))
                endpoints[name] = front
        regions = [
            {
                "name": name,
                "endpoint": "{}:{}".format(*endpoints[name]),
                "caFile": str(tier1[name].ca),
                "tags": {"residency": residency},
                "costs": {LLAMA: {"perMillionTokens": price}},
            }
            for name, _, _, price, residency in REGIONS
        ]
        doc = global_config(
            regions,
            models=[{"name": LLAMA, "policy": "cheapest-within-slo", "ttftSlo": slo}],
            polling=polling or {"interval": "100ms", "staleAfter": "1s"},
        )
        with start_global_router(tmp, doc) as router:
            wait_fresh(router, {n for n, *_ in REGIONS})
            yield World(router, tier1, configs, tmp, endpoints, proxies)


def status(router: GlobalRouter) -> dict:
    return httpx.get(router.status_url, timeout=5).json()


def fresh(router: GlobalRouter) -> set[str]:
    """Regions fresh with every pod ready (suspect or not)."""
    return {r["name"] for r in status(router)["regions"] if r["fresh"] and all(
        p["readyPods"] == p["pods"] for p in r["pools"])}


def placeable_first(router: GlobalRouter) -> set[str]:
    """Regions the router would put at the front: fresh, ready and not suspect."""
    regions = {r["name"]: r for r in status(router)["regions"]}
    return {n for n in fresh(router) if not regions[n]["suspect"]}


def wait_fresh(router: GlobalRouter, names: set[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not names <= placeable_first(router):
        assert time.monotonic() < deadline, f"regions not fresh: {status(router)}"
        time.sleep(0.1)


def client(router: GlobalRouter) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(router.ca))
    return httpx.Client(base_url=router.url, verify=ctx, timeout=30)


def chat(http: httpx.Client, regions: str | None = None) -> httpx.Response:
    headers = {hdr.REGIONS: regions} if regions is not None else {}
    return http.post("/v1/chat/completions", json=BODY, headers=headers)


# --- partitions -----------------------------------------------------------------------------


def _iptables(action: str, rule: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", action, "INPUT", *rule], capture_output=True, text=True,
                          timeout=10, check=False)


def partition_supported() -> str | None:
    """Why a partition cannot be made here, or None when it can."""
    if shutil.which("iptables") is None:
        return "iptables not installed (.ci/system-deps installs it)"
    if os.geteuid() != 0:
        return "dropping packets needs root"
    probe = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True,
                           timeout=10, check=False)
    return None if probe.returncode == 0 else f"iptables unusable: {probe.stderr.strip()}"


def require_partitions() -> None:
    reason = partition_supported()
    if reason is not None:
        pytest.skip(reason)


class Partition:
    """Drops every TCP packet to and from one `address:port` (both directions: requests
    and answers alike vanish, nothing is reset), until `heal`. Scoped to the port, so
    other tests on the same loopback address are not touched."""

    def __init__(self, address: str, port: int) -> None:
        comment = ["-m", "comment", "--comment", f"igw-test-partition-{os.getpid()}"]
        self.rules = [
            ["-p", "tcp", "-d", address, "--dport", str(port), *comment, "-j", "DROP"],
            ["-p", "tcp", "-s", address, "--sport", str(port), *comment, "-j", "DROP"],
        ]
        self.active = False

    def start(self) -> None:
        for rule in self.rules:
            done = _iptables("-I", rule)
            assert done.returncode == 0, done.stderr
        self.active = True

    def heal(self) -> None:
        if self.active:
            for rule in self.rules:
                _iptables("-D", rule)
            self.active = False


@contextlib.contextmanager
def partition(address: str, port: int) -> Iterator[Partition]:
    """A Partition, healed at the end whatever happens (started by the caller)."""
    part = Partition(address, port)
    try:
        yield part
    finally:
        part.heal()
