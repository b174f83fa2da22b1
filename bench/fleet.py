"""The simulated fleet as a child process: start, reset between routers, sample, stop.

One `python -m simulator --fleet FILE --control-port P` per scenario. Before each router's
run every pod is restarted through the control port (fresh engine: empty queue, empty KV
and prefix cache, no resident adapters, counters at zero), so each router meets the same
fleet in the same state. During a run `QueueSampler` reads every pod's `/admin/state`
(waiting and running requests, KV use) a few times a second for the queue-depth plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.procs import Child, start_child, wait_log_line
from igw.ports import free_ports

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Pod:
    name: str
    gpu: str
    model: str
    port: int
    lora_adapters: tuple[str, ...] = ()
    engine: str = "vllm"  # the fleet spec's engine: whose page the pod writes

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class SimFleet:
    """A running simulator process and the pods it serves."""

    def __init__(self, child: Child, pods: list[Pod], control_port: int, spec_path: Path):
        self.child = child
        self.pods = pods
        self.control_port = control_port
        self.spec_path = spec_path

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def pid(self) -> int:
        return self.child.pid

    def pools(self) -> dict[str, list[Pod]]:
        """Pods by served base model, in spec order."""
        out: dict[str, list[Pod]] = {}
        for pod in self.pods:
            out.setdefault(pod.model, []).append(pod)
        return out

    @classmethod
    def start(
        cls, work: Path, pods: list[dict[str, Any]], *, seed: int, time_scale: float
    ) -> SimFleet:
        """Write the spec with free ports and start the simulator; returns once it is ready."""
        ports = free_ports(len(pods) + 1)
        spec_pods = [{**p, "port": port} for p, port in zip(pods, ports, strict=False)]
        spec = {"seed": seed, "time_scale": time_scale, "pods": spec_pods}
        work.mkdir(parents=True, exist_ok=True)
        path = work / "fleet.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        log = work / "simulator.log"
        log.unlink(missing_ok=True)
        child = start_child(
            "simulator",
            [sys.executable, "-m", "simulator", "--fleet", str(path), "--control-port",
             str(ports[-1])],
            log,
        )
        wait_log_line(child, lambda line: "simulator ready" in line, READY_TIMEOUT_S)
        out = [
            Pod(p["name"], p["gpu"], p["model"], p["port"], tuple(p.get("lora_adapters", ())),
                p.get("engine", "vllm"))
            for p in spec_pods
        ]
        return cls(child, out, ports[-1], path)

    def stop(self) -> None:
        self.child.stop()

    async def reset(self, session: aiohttp.ClientSession) -> None:
        """Restart every pod (fresh engine, same port) and wait until each answers /health."""
        for pod in self.pods:
            async with session.post(f"{self.control_url}/pods/{pod.name}/restart") as resp:
                resp.raise_for_status()
        deadline = time.monotonic() + 10
        for pod in self.pods:
            while True:
                try:
                    async with session.get(f"{pod.url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pod {pod.name} not healthy after restart")
                await asyncio.sleep(0.05)

    async def states(self, session: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        """Every pod's /admin/state (through the control port)."""
        out: dict[str, dict[str, Any]] = {}
        for pod in self.pods:
            async with session.get(f"{self.control_url}/pods/{pod.name}/state") as resp:
                out[pod.name] = orjson.loads(await resp.read())
        return out


STATE_KEYS = ("num_requests_waiting", "num_requests_running", "kv_cache_usage")


class QueueSampler:
    """Polls every pod's state every `interval` seconds into a compact timeline."""

    def __init__(self, fleet: SimFleet, session: aiohttp.ClientSession, interval: float = 0.5):
        self.fleet = fleet
        self.session = session
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            t = time.monotonic() - self._t0
            try:
                states = await self.fleet.states(self.session)
            except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
                states = {}
            if states:
                self.samples.append(
                    {
                        "t": round(t, 3),
                        "pods": {
                            name: [s.get(k, 0) for k in STATE_KEYS] for name, s in states.items()
                        },
                    }
                )
            await asyncio.sleep(self.interval)
