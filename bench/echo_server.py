"""A model server that costs (almost) nothing: for measuring what a router adds per request.

Raw asyncio HTTP/1.1 with keep-alive, no framework. Answers
- `POST /v1/chat/completions`, `POST /v1/completions`: a fixed one-token OpenAI response
  (non-streaming);
- `GET /metrics`: vLLM metrics of an idle engine (so the gateway sees a fresh, ready pod);
- `GET /health`, `GET /v1/models`: 200.

    python -m bench.echo_server --port 18000

Prints `echo ready <port>` once listening; SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
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


class EchoProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: Any = None

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
            if method == b"POST":
                out.append(RESPONSES[b"POST"])
            else:
                out.append(RESPONSES.get(path, RESPONSES[b"404"]))
        if out and self.transport is not None:
            self.transport.write(b"".join(out))


async def serve(port: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoProtocol, host, port, backlog=1024)
    print(f"echo ready {port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    with contextlib.suppress(Exception):
        await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.port))
    else:
        uvloop.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
