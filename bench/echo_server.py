"""A model server that costs (almost) nothing: for measuring what a router adds per request.

Raw asyncio HTTP/1.1 with keep-alive, no framework. Answers
- `POST /v1/chat/completions`, `POST /v1/completions`: a fixed one-token OpenAI response
  (non-streaming); with `--stream-events N`, an SSE stream of N one-token chat events
  instead (role event, N tokens, finish, [DONE]), each written in its own loop
  iteration so a proxy reads them as separate chunks, as it would from an engine;
- `GET /metrics`: vLLM metrics of an idle engine (so the gateway sees a fresh, ready pod);
- `GET /health`, `GET /v1/models`: 200.

    python -m bench.echo_server --port 18000 [--stream-events 64]

Prints `echo ready <port>` once listening; SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

COMPLETION = (
    b'{"id":"cmpl-echo","object":"chat.completion","created":0,"model":"echo-model",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)
METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="echo-model"} 0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="echo-model"} 0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="echo-model"} 0\n'
    b'vllm:gpu_cache_usage_perc{engine="0",model_name="echo-model"} 0\n'
    b'vllm:cache_config_info{block_size="16",num_gpu_blocks="25000",engine="0"} 1\n'
)
MODELS = b'{"object":"list","data":[{"id":"echo-model","object":"model","owned_by":"echo"}]}'


def _response(status: bytes, body: bytes, ctype: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nx-sim-pod: echo\r\n\r\n" + body)


RESPONSES = {
    b"POST": _response(b"200 OK", COMPLETION, b"application/json"),
    b"/metrics": _response(b"200 OK", METRICS, b"text/plain; version=0.0.4"),
    b"/health": _response(b"200 OK", b"", b"text/plain"),
    b"/v1/models": _response(b"200 OK", MODELS, b"application/json"),
    b"404": _response(b"404 Not Found", b"", b"text/plain"),
}


_EVENT = (b'data: {"id":"chatcmpl-echo","object":"chat.completion.chunk","created":0,'
          b'"model":"echo-model","choices":[{"index":0,"delta":{"content":"ok"},'
          b'"logprobs":null,"finish_reason":null}]}\n\n')
_ROLE = _EVENT.replace(b'{"content":"ok"}', b'{"role":"assistant","content":""}')
_FINISH = _EVENT.replace(b'{"content":"ok"}', b"{}").replace(
    b'"finish_reason":null', b'"finish_reason":"length"')
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\nx-sim-pod: echo\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def stream_chunks(events: int) -> list[bytes]:
    """The HTTP/1.1 chunks of one streamed answer, the headers with the first."""
    body = [_ROLE, *([_EVENT] * events), _FINISH + b"data: [DONE]\n\n"]
    out = [_chunk(e) for e in body]
    out[0] = STREAM_HEAD + out[0]
    out[-1] += b"0\r\n\r\n"
    return out


class EchoProtocol(asyncio.Protocol):
    def __init__(self, stream_events: int = 0) -> None:
        self.buf = b""
        self.transport: Any = None
        self.stream = stream_chunks(stream_events) if stream_events else None

    def connection_made(self, transport: Any) -> None:  # uvloop's is no asyncio.Transport
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        out = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                length = int(head[i + 15 : j if j >= 0 else None].strip())
            total = end + 4 + length
            if len(self.buf) < total:
                break
            method, _, rest = head.partition(b" ")
            path = rest.partition(b" ")[0].partition(b"?")[0]
            self.buf = self.buf[total:]
            if method == b"POST" and self.stream is not None:
                self._write_stream(list(reversed(self.stream)))
            elif method == b"POST":
                out.append(RESPONSES[b"POST"])
            else:
                out.append(self.answer_get(path))
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def answer_get(self, path: bytes) -> bytes:
        """The whole HTTP/1.1 answer to a request other than a POST."""
        return RESPONSES.get(path, RESPONSES[b"404"])

    def _write_stream(self, left: list[bytes]) -> None:
        """One chunk now, the next in the loop's next iteration (clients send one
        request at a time on a connection, so streams never interleave)."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(left.pop())
        if left:
            asyncio.get_running_loop().call_soon(self._write_stream, left)


async def serve_until_signalled(factory: Callable[[], asyncio.Protocol], port: int,
                                host: str = "127.0.0.1", *, announce: str | None = None
                                ) -> None:
    """Serve `factory`'s protocol on host:port, print `announce` (else `echo ready PORT`),
    stop on SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, host, port, backlog=1024)
    print(announce or f"echo ready {port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    with contextlib.suppress(Exception):
        await server.wait_closed()


async def serve(port: int, host: str = "127.0.0.1", stream_events: int = 0) -> None:
    await serve_until_signalled(lambda: EchoProtocol(stream_events), port, host)


def run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop when it is installed (it is in the project's environment)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--stream-events", type=int, default=0,
                   help="answer POSTs with an SSE stream of this many token events")
    args = p.parse_args(argv)
    run(serve(args.port, stream_events=args.stream_events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
