"""A model server that remembers the request headers it got: what reached the pod.

It can also take its time (`delay_s`), to hold requests in flight.

Serves an idle vLLM `/metrics` page (bench.echo_server's) so the gateway sees
a fresh, ready pod, and answers chat completions with a one-token reply. Runs
its own event loop in a thread, so a test that blocks on the gateway's child
process can still be answered. Test support: no part of the product.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from bench.echo_server import COMPLETION, METRICS
from igw.ports import free_port

START_TIMEOUT_S = 10.0


@dataclass
class HeaderPod:
    address: str
    seen: list[dict[str, str]] = field(default_factory=list)
    # How long each completion takes (a test sets it to hold requests in flight).
    delay_s: float = 0.0


def _app(pod: HeaderPod) -> web.Application:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        pod.seen.append({k.lower(): v for k, v in request.headers.items()})
        if pod.delay_s:
            await asyncio.sleep(pod.delay_s)
        return web.Response(body=COMPLETION, content_type="application/json")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    return app


@contextlib.contextmanager
def header_pod() -> Iterator[HeaderPod]:
    """Serve on a free loopback port until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="header-pod", daemon=True)
    thread.start()
    port = free_port()
    pod = HeaderPod(f"127.0.0.1:{port}")
    runner = web.AppRunner(_app(pod), access_log=None)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    try:
        asyncio.run_coroutine_threadsafe(start(), loop).result(START_TIMEOUT_S)
        yield pod
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(START_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(START_TIMEOUT_S)
        loop.close()
