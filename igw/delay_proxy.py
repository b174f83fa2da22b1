"""A TCP proxy that adds a fixed round-trip time: distance between regions, on one machine.

`igw global up` puts one in front of each region's Tier-1 listener so the
global router measures, and places on, RTTs like those between real regions.
Each direction delays every chunk by half the RTT and keeps the order; TLS
passes through untouched. The RTT can be changed while it runs (`set_rtt`: a
region turning slow); open connections follow from their next chunk. Bounded: a
direction holds at most `MAX_CHUNKS` chunks in flight, then stops reading (TCP
backpressure does the rest).

    python -m igw.delay_proxy --listen 127.0.0.2:9443 --upstream 127.0.0.2:8443 --rtt 0.07
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from contract.endpoints import EndpointError, split_endpoint

log = logging.getLogger("igw.delay_proxy")

MAX_CHUNKS = 256
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 5.0


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                proxy: DelayProxy) -> None:
    """Copy reader → writer, each chunk the proxy's one-way delay after it was read, in
    order."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_CHUNKS)

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while True:
            data = await reader.read(CHUNK)
            await queue.put((loop.time() + proxy.one_way_s, data))
            if not data:
                break
        await sender
    finally:
        if not sender.done():
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender


class DelayProxy:
    """Listens on `listen`, connects each client to `upstream`, adds `rtt_s`."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], rtt_s: float) -> None:
        self.listen = listen
        self.upstream = upstream
        self.one_way_s = rtt_s / 2.0
        self._server: asyncio.Server | None = None

    def set_rtt(self, rtt_s: float) -> None:
        self.one_way_s = rtt_s / 2.0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, *self.listen)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up_r, up_w = await asyncio.open_connection(*self.upstream)
        except (OSError, TimeoutError) as exc:
            log.debug("upstream %s:%d unreachable: %s", *self.upstream, exc)
            client_w.close()
            return
        try:
            await asyncio.gather(
                _pump(client_r, up_w, self), _pump(up_r, client_w, self)
            )
        except (OSError, ConnectionError):
            pass
        finally:
            for w in (client_w, up_w):
                w.close()


def _address(text: str) -> tuple[str, int]:
    try:
        return split_endpoint(text)
    except EndpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _run(proxy: DelayProxy) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await proxy.start()
    print(f"delay proxy ready {proxy.listen[0]}:{proxy.listen[1]}", flush=True)
    await done.wait()
    await proxy.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m igw.delay_proxy")
    parser.add_argument("--listen", type=_address, required=True, help="host:port to accept on")
    parser.add_argument("--upstream", type=_address, required=True, help="host:port to reach")
    parser.add_argument("--rtt", type=float, default=0.05, help="round-trip time added, s")
    args = parser.parse_args(argv)
    if not 0 <= args.rtt <= 10:
        parser.error("--rtt must be between 0 and 10 seconds")
    asyncio.run(_run(DelayProxy(args.listen, args.upstream, args.rtt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
