"""Stand-in model-server pods that serve `/metrics` pages you control.

For the data layer's tests and benchmark only: a tiny aiohttp server per pod
whose page is rendered from a `PodState` (standin_pages.py), and which can be told
to misbehave (HTTP 500, garbage, an HTML error page, hanging) or be stopped
(connection refused) and started again on the same port. Unlike the simulator's
pods, nothing here models an engine: the page says exactly what the test set.

    python -m simulator.standin --count 64 --engine vllm   (the benchmark's fleet)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from typing import Literal

from aiohttp import web

from simulator.standin_pages import PodState, busy_state, render

Mode = Literal["ok", "error", "garbage", "html", "hang"]
GARBAGE = "vllm:num_requests_waiting{model_name=\"m\" 3\n\x00\x01 not a metrics page }}}\n"
HTML = "<html><body><h1>502 Bad Gateway</h1></body></html>\n"
MAX_HANG_S = 60.0


class StandInPod:
    """One pod: `await start()`, change `state` / `mode` at will, `await stop()`."""

    def __init__(self, engine: str = "vllm", state: PodState | None = None, *,
                 mode: Mode = "ok", static_body: bytes | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.state = state or PodState()
        self.mode: Mode = mode
        self.static_body = static_body
        self.host = host
        self.port = port
        self.hits = 0
        self._runner: web.AppRunner | None = None
        self._release = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> str:
        """Listen (on the same port again after a stop); returns `host:port`."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._release = asyncio.Event()
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = int(runner.addresses[0][1])
        self._runner = runner
        return self.address

    async def stop(self) -> None:
        """Close the listener: new connections are refused until `start()`."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def body(self) -> bytes:
        if self.static_body is not None:
            return self.static_body
        return render(self.engine, self.state).encode()

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "hang":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), MAX_HANG_S)
        if self.mode == "error":
            return web.Response(status=500, text="internal error\n")
        if self.mode == "garbage":
            return web.Response(text=GARBAGE, content_type="text/plain")
        if self.mode == "html":
            return web.Response(text=HTML, content_type="text/html")
        return web.Response(body=self.body(), content_type="text/plain",
                            headers={"X-Pod": self.address})


async def serve_fleet(count: int, engine: str, host: str = "127.0.0.1") -> None:
    """Run `count` pods serving one pre-rendered busy page each; print their addresses.

    Runs until stdin closes or the process is terminated: the benchmark keeps
    these in a process of their own so only the collector's CPU is measured.
    """
    state = busy_state()
    body = render(engine, state).encode()
    pods = [StandInPod(engine, state, static_body=body, host=host) for _ in range(count)]
    addresses = [await pod.start() for pod in pods]
    print(json.dumps(addresses), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.add_reader(sys.stdin.fileno(), done.set)  # EOF on stdin: the parent is gone
    await done.wait()
    for pod in pods:
        await pod.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="stand-in pods serving engine /metrics")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--engine", default="vllm")
    args = parser.parse_args()
    asyncio.run(serve_fleet(args.count, args.engine))
