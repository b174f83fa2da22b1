"""Many pods in one process, plus the optional control port: the simulator's Python API.

    async with Fleet.from_spec({"pods": [{"gpu": "h100", "model": "llama-3.1-8b"}]}) as fleet:
        pod = fleet.pod("pod-0")          # PodServer: .url, .port, .engine, .faults
        ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from simulator.control import control_app
from simulator.server import SHUTDOWN_TIMEOUT_S, PodServer
from simulator.spec import DEFAULT_HOST, FleetSpec, load_fleet, parse_fleet


class Fleet:
    """A set of simulated pods sharing one event loop (and one seed and time scale)."""

    def __init__(self, spec: FleetSpec, control_port: int | None = None,
                 control_host: str = DEFAULT_HOST,
                 on_crash: Callable[[PodServer], None] | None = None) -> None:
        self.spec = spec
        self.pods: dict[str, PodServer] = {
            p.name: PodServer(p, seed=spec.seed, time_scale=spec.time_scale, on_crash=on_crash)
            for p in spec.pods
        }
        self.control_host = control_host
        self.control_port = control_port
        self._control: web.AppRunner | None = None

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | FleetSpec, **kwargs: Any) -> Fleet:
        """Build from a fleet dict (the YAML's shape) or a parsed FleetSpec."""
        return cls(spec if isinstance(spec, FleetSpec) else parse_fleet(spec), **kwargs)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> Fleet:
        return cls(load_fleet(path), **kwargs)

    def pod(self, name: str) -> PodServer:
        return self.pods[name]

    @property
    def control_url(self) -> str | None:
        if self._control is None:
            return None
        return f"http://{self.control_host}:{self.control_port}"

    async def start(self) -> None:
        """Open every pod's listener (and the control port); on any failure close them all."""
        try:
            await asyncio.gather(*(p.start() for p in self.pods.values()))
            if self.control_port is not None:
                await self._start_control()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.pods.values()), return_exceptions=True)
        runner, self._control = self._control, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    async def _start_control(self) -> None:
        runner = web.AppRunner(control_app(self.pods), access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        self._control = runner
        site = web.TCPSite(runner, self.control_host, self.control_port)
        await site.start()
        self.control_port = runner.addresses[0][1]
