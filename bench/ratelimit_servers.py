"""The two limit designs as processes, for bench/ratelimit.py to put behind Envoy.

    python -m bench.ratelimit_servers rls PORT REDIS_PORT [--limit N]
    python -m bench.ratelimit_servers picker PORT REDIS_PORT [--limit N] [--tenants K]

Prints `ratelimit ready KIND PORT` once listening on 127.0.0.1:PORT; SIGTERM stops it.

- `rls` (design a): a rate-limit service speaking Envoy's `envoy.service.ratelimit.v3`
  (RateLimitService.ShouldRateLimit) on grpcio's asyncio server, with xds-protos'
  generated stubs. Per call, per descriptor: one pipelined INCRBY + EXPIRE of a
  fixed-window key in Redis (the usual design of a Redis-backed rate-limit service),
  then OK or OVER_LIMIT against the configured limit. Envoy's rate-limit filter asks it
  on every request.
- `picker` (design b): the do-nothing h2-grpc ext_proc stub of bench/ext_proc_stubs.py
  with the product's limiter (picker.tenants.limits) on it: every request is admitted
  against a tenant's limits (its body's length / 4 as the token reservation) and
  released when Envoy ends the stream; the limiter syncs with the same Redis in the
  background (`--tenants` configured tenants, one with traffic). A refusal answers 429.

The limit is set high enough that nothing is refused: the benchmark measures what a
check costs, not what a refusal saves.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import redis.asyncio as aioredis
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import http_status_pb2

from bench.ext_proc_stubs import MAX_MESSAGE, PROCESS_PATH, answer
from contract.config import CoordinationConfig, RateLimits
from picker.coordination.bus import redis_client
from picker.h2_grpc import H2GrpcServer, Stream
from picker.tenants.limits import Grant, Limiter, RateLimited

KINDS = ("rls", "picker")
TENANT = "bench"
MODEL = "echo-model"
WINDOW_S = 60


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):
    """ShouldRateLimit: one Redis round trip per call, whatever the descriptors."""

    def __init__(self, redis: aioredis.Redis, limit: int) -> None:
        self.redis = redis
        self.limit = limit

    async def ShouldRateLimit(  # the generated servicer's method name
        self, request: rls_pb2.RateLimitRequest, context: Any
    ) -> rls_pb2.RateLimitResponse:
        window = int(time.time() // WINDOW_S)
        hits = request.hits_addend or 1
        pipe = self.redis.pipeline(transaction=False)
        for descriptor in request.descriptors:
            parts = ":".join(f"{e.key}={e.value}" for e in descriptor.entries)
            key = f"rl:{request.domain}:{parts}:{window}"
            pipe.incrby(key, hits)
            pipe.expire(key, WINDOW_S)
        replies = await pipe.execute()
        code = rls_pb2.RateLimitResponse.OK
        statuses = []
        for count in replies[0::2]:
            over = count > self.limit
            if over:
                code = rls_pb2.RateLimitResponse.OVER_LIMIT
            statuses.append(rls_pb2.RateLimitResponse.DescriptorStatus(
                code=rls_pb2.RateLimitResponse.OVER_LIMIT if over else
                rls_pb2.RateLimitResponse.OK,
                limit_remaining=max(0, self.limit - count)))
        return rls_pb2.RateLimitResponse(overall_code=code, statuses=statuses)


async def _rls(port: int, redis_port: int, limit: int, stop: asyncio.Event, _: int) -> None:
    import grpc

    settings = CoordinationConfig(url=f"redis://127.0.0.1:{redis_port}/0", timeout_s=1.0)
    redis = redis_client(settings, None, 1.0, 64)
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitService(redis, limit), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _ready("rls", port)
    await stop.wait()
    await server.stop(0.5)
    await redis.aclose()


_REFUSED = ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
    status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests)))


class LimitedStub:
    """The h2-grpc stub plus the limiter: admit on the body, release at the stream's end."""

    __slots__ = ("grant", "stream")
    limiter: Limiter

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.grant: Grant | None = None

    def on_message(self, message: bytes) -> None:
        request = ext_proc.ProcessingRequest.FromString(message)
        reply = answer(request)
        if request.WhichOneof("request") == "request_body":
            tokens = len(request.request_body.body) // 4 + 1
            try:
                self.grant = self.limiter.admit(TENANT, MODEL, tokens, time.monotonic())
            except RateLimited:
                reply = _REFUSED
        self.stream.send(reply.SerializeToString())

    def on_end(self, reset: bool) -> None:
        if self.grant is not None:
            self.limiter.release(self.grant)
            self.grant = None
        self.stream.finish()


async def _picker(port: int, redis_port: int, limit: int, stop: asyncio.Event,
                  tenants: int) -> None:
    limiter = Limiter()
    table = {}
    for i in range(tenants):  # the bench tenant and others that send nothing
        name = TENANT if i == 0 else f"tenant-{i}"
        big = RateLimits(requests_per_minute=limit, tokens_per_minute=1000 * limit,
                         max_concurrent_requests=limit)
        table[(name, "")] = big
        table[(name, MODEL)] = big
    limiter.configure(table)
    settings = CoordinationConfig(url=f"redis://127.0.0.1:{redis_port}/0", timeout_s=0.25)
    await limiter.start(lambda: redis_client(settings, None, 0.25, 2), "igw:bench",
                        replica="bench-0")
    LimitedStub.limiter = limiter
    server = H2GrpcServer({PROCESS_PATH: LimitedStub}, max_message=MAX_MESSAGE)
    await server.start("127.0.0.1", port)
    _ready("picker", port)
    await stop.wait()
    await server.stop(0.5)
    status = limiter.status()
    await limiter.stop()
    print(f"limiter status {status}", flush=True)


SERVERS = {"rls": _rls, "picker": _picker}


def _ready(kind: str, port: int) -> None:
    print(f"ratelimit ready {kind} {port}", flush=True)


async def _serve(kind: str, port: int, redis_port: int, limit: int, tenants: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await SERVERS[kind](port, redis_port, limit, stop, tenants)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ratelimit_servers")
    p.add_argument("kind", choices=KINDS)
    p.add_argument("port", type=int)
    p.add_argument("redis_port", type=int)
    p.add_argument("--limit", type=int, default=10**9)
    p.add_argument("--tenants", type=int, default=50)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args.kind, args.port, args.redis_port, args.limit, args.tenants))
    else:
        uvloop.run(_serve(args.kind, args.port, args.redis_port, args.limit, args.tenants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
