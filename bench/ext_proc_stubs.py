"""Three do-nothing ext_proc servers, for bench/ext_proc_servers.py to put behind Envoy.

    python -m bench.ext_proc_stubs {grpc-aio,grpclib,h2-grpc} PORT

Prints `stub ready KIND PORT` once listening on 127.0.0.1:PORT; SIGTERM stops it. Kept
apart from the benchmark driver so a stub process imports only what its server needs.

Equal work in each: parse every ProcessingRequest, answer it with the same prebuilt
CONTINUE response for its phase (serialized per answer), and keep the stream open until
Envoy ends it, as the picker does. Each runs on uvloop when installed, as the picker does.
- `grpc-aio`: grpcio's asyncio server with xds-protos' generated servicer;
- `grpclib`: grpclib (asyncio on the `h2` package); xds-protos ships no grpclib stubs,
  so the service is mapped by hand (`const.Cardinality.STREAM_STREAM`) onto the
  xds-protos message classes;
- `h2-grpc`: picker/h2_grpc.py's H2GrpcServer with a trivial StreamHandler.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from picker.h2_grpc import H2GrpcServer, Stream

STUBS = ("grpc-aio", "grpclib", "h2-grpc")
PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# The largest message a stub accepts: a body up to the harness's 1 MiB limit, plus room.
MAX_MESSAGE = (1 << 20) + (64 << 10)

# One prebuilt answer per phase the processing mode sends: CONTINUE, nothing changed.
_CONTINUE = {
    "request_headers": ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()),
    "request_body": ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse()),
}


def answer(request: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
    """The least that lets the request go on; any other phase is a configuration error."""
    return _CONTINUE[request.WhichOneof("request")]


class GrpcAioStub(ext_proc_grpc.ExternalProcessorServicer):
    async def Process(  # the generated servicer's method name
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        async for request in request_iterator:
            yield answer(request)


class GrpclibStub:
    """grpclib's IServable, written by hand: xds-protos ships only grpcio stubs."""

    def __mapping__(self) -> dict[str, Any]:
        from grpclib.const import Cardinality, Handler

        return {PROCESS_PATH: Handler(self.process, Cardinality.STREAM_STREAM,
                                      ext_proc.ProcessingRequest, ext_proc.ProcessingResponse)}

    async def process(self, stream: Any) -> None:
        async for request in stream:
            await stream.send_message(answer(request))


class H2Stub:
    """picker.h2_grpc StreamHandler: answer each message, finish when Envoy ends the call."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def on_message(self, message: bytes) -> None:
        request = ext_proc.ProcessingRequest.FromString(message)
        self.stream.send(answer(request).SerializeToString())

    def on_end(self, reset: bool) -> None:
        self.stream.finish()


async def _grpc_aio(port: int, stop: asyncio.Event) -> None:
    import grpc

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(GrpcAioStub(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _ready("grpc-aio", port)
    await stop.wait()
    await server.stop(0.5)


async def _grpclib(port: int, stop: asyncio.Event) -> None:
    from grpclib.server import Server

    server = Server([GrpclibStub()])
    await server.start("127.0.0.1", port)
    _ready("grpclib", port)
    await stop.wait()
    server.close()
    await server.wait_closed()


async def _h2_grpc(port: int, stop: asyncio.Event) -> None:
    server = H2GrpcServer({PROCESS_PATH: H2Stub}, max_message=MAX_MESSAGE)
    await server.start("127.0.0.1", port)
    _ready("h2-grpc", port)
    await stop.wait()
    await server.stop(0.5)


SERVERS = {"grpc-aio": _grpc_aio, "grpclib": _grpclib, "h2-grpc": _h2_grpc}


def _ready(kind: str, port: int) -> None:
    print(f"stub ready {kind} {port}", flush=True)


async def _serve(kind: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await SERVERS[kind](port, stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ext_proc_stubs")
    p.add_argument("kind", choices=STUBS)
    p.add_argument("port", type=int)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args.kind, args.port))
    else:
        uvloop.run(_serve(args.kind, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
