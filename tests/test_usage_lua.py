"""The response-side output token counter (igw_envoy.usage's Lua) in a real Envoy.

A bare Envoy runs the gateway's own `usage_filter` in front of an upstream that
writes each response in pieces cut where a naive scan would miss or double count
(inside `"completion_tokens"`, inside `data: {`), 15 ms apart so Envoy gets them
as separate chunks. What the filter leaves in the `igw.usage` dynamic metadata is
read from Envoy's own file access log, so every case is the real filter's output.
Besides the constructed cases, every real engine stream in tests/fixtures/sse (each
names its source) is a case. The end-to-end path (Envoy's gRPC access log to the
picker, the ledger, the metrics) is tests/test_tenants_gateway.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from bench.ext_proc_servers import start_envoy
from bench.procs import Child
from igw.ports import free_ports
from igw_envoy.http_filters import router_filter, usage_filter
from tests.standin_thread import loop_thread

CHAT_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
              b'"delta":{"content":"w"},"finish_reason":null}]}\n\n')
ROLE_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
              b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n')
FINISH_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
                b'"delta":{},"finish_reason":"length"}]}\n\n')
TEXT_EVENT = (b'data: {"id":"t","object":"text_completion","choices":[{"index":0,'
              b'"text":"w","finish_reason":null}]}\n\n')
TEXT_FINISH = (b'data: {"id":"t","object":"text_completion","choices":[{"index":0,'
               b'"text":"","finish_reason":"stop"}]}\n\n')
DONE = b"data: [DONE]\n\n"
# Envoy writes its file access log every 10 s by default.
FLUSH_FAST = ("--file-flush-interval-msec", "50")


def usage_event(n: int) -> bytes:
    return (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":'
            b'{"prompt_tokens":3,"total_tokens":%d,"completion_tokens":%d}}\n\n' % (n + 3, n))


def json_body(n: int) -> bytes:
    return json.dumps({
        "id": "c", "object": "chat.completion",
        # generated text that looks like the key: escaped quotes, never structure
        "choices": [{"index": 0, "message": {"role": "assistant",
                                             "content": 'say "completion_tokens": 999'}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3,
                  "completion_tokens_details": None},
    }).encode()


def cut(data: bytes, marker: bytes, offset: int) -> list[bytes]:
    """`data` in two pieces, cut `offset` bytes into the first `marker`."""
    at = data.index(marker) + offset
    return [data[:at], data[at:]]


def sse(events: list[bytes]) -> bytes:
    return b"".join(events)


STREAM_9 = sse([ROLE_EVENT] + [CHAT_EVENT] * 9 + [FINISH_EVENT, DONE])
# (path, content type, status, pieces) → expected (output_tokens, exact) or None
CASES: dict[str, tuple[str, int, list[bytes], tuple[int, bool] | None]] = {
    "/json": ("application/json", 200, [json_body(17)], (17, True)),
    "/json-cut-key": ("application/json", 200, cut(json_body(23), b'"completion_tokens": 23', 9),
                      (23, True)),
    "/json-cut-number": ("application/json", 200,
                         cut(json_body(456), b'"completion_tokens": 456', 22), (456, True)),
    # one piece per event, then the same stream cut inside every `data: {`
    "/sse": ("text/event-stream", 200, [ROLE_EVENT] + [CHAT_EVENT] * 9 + [FINISH_EVENT, DONE],
             (9, False)),
    "/sse-cut-markers": ("text/event-stream", 200,
                         [STREAM_9[i:i + 100] for i in range(0, len(STREAM_9), 100)],
                         (9, False)),
    "/sse-one-piece": ("text/event-stream", 200, [STREAM_9], (9, False)),
    "/sse-usage": ("text/event-stream", 200,
                   [ROLE_EVENT] + [CHAT_EVENT] * 4 + [FINISH_EVENT, usage_event(4), DONE],
                   (4, True)),
    "/sse-completions": ("text/event-stream", 200, [TEXT_EVENT] * 6 + [TEXT_FINISH, DONE],
                         (6, False)),
    "/error": ("application/json", 500, [json_body(5)], None),
    "/empty-stream": ("text/event-stream", 200, [DONE], None),
}


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sse"


def fixture_case(path: Path) -> tuple[str, int, list[bytes], tuple[int, bool]]:
    """A real engine's stream (tests/fixtures/sse, each naming its source) and what its
    `# expect:` line says the count is, sent one event per piece."""
    lines = path.read_text().splitlines(keepends=True)
    expect = next(x for x in lines if x.startswith("# expect:"))
    tokens = int(expect.split("output_tokens")[1].split(",")[0])
    body = "".join(x for x in lines if not x.startswith("# ")).encode()
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    return ("text/event-stream", 200, events, (tokens, "estimated" not in expect))


for _path in sorted(FIXTURES.glob("*.sse")):
    CASES[f"/fixture/{_path.stem}"] = fixture_case(_path)


@contextlib.contextmanager
def upstream(port: int) -> Iterator[None]:
    async def handle(request: web.Request) -> web.StreamResponse:
        ctype, status, pieces, _ = CASES[request.path]
        resp = web.StreamResponse(status=status, headers={"content-type": ctype})
        await resp.prepare(request)
        for piece in pieces:
            await resp.write(piece)
            await asyncio.sleep(0.015)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    with loop_thread("usage-upstream") as run:
        run(start())
        try:
            yield
        finally:
            run(runner.cleanup())


def bootstrap(listen: int, admin: int, up: int, log: Path) -> dict:
    log_format = {"json_format": {
        "path": "%REQ(:PATH)%",
        "output_tokens": "%DYNAMIC_METADATA(igw.usage:output_tokens)%",
        "exact": "%DYNAMIC_METADATA(igw.usage:exact)%",
    }}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "t",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "up"}}]}]},
        "http_filters": [usage_filter(), router_filter()],
        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(log), "log_format": log_format}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": {
                "address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": hcm}]}]}],
            "clusters": [{"name": "up", "type": "STATIC", "connect_timeout": "1s",
                          "load_assignment": {"cluster_name": "up", "endpoints": [{"lb_endpoints": [
                              {"endpoint": {"address": {"socket_address": {
                                  "address": "127.0.0.1", "port_value": up}}}}]}]}}],
        },
    }


@pytest.fixture(scope="module")
def envoy(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("usage-lua")
    listen, admin, up = free_ports(3)
    log = tmp / "access.log"
    children: list[Child] = []
    with upstream(up):
        try:
            start_envoy(bootstrap(listen, admin, up, log), admin, tmp, children,
                        extra_args=("--concurrency", "1", *FLUSH_FAST))
            yield f"http://127.0.0.1:{listen}", log
        finally:
            for child in children:
                child.stop()


def logged(log: Path, path: str, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                if entry["path"] == path:
                    return entry
        time.sleep(0.05)
    raise AssertionError(f"no access log line for {path}")


@pytest.mark.parametrize("path", sorted(CASES))
def test_output_tokens_left_in_metadata(envoy, path):
    url, log = envoy
    _, status, pieces, expected = CASES[path]
    response = httpx.get(url + path, timeout=10)
    assert response.status_code == status
    assert response.content == b"".join(pieces)  # passed through untouched
    entry = logged(log, path)
    if expected is None:
        assert entry["output_tokens"] is None and entry["exact"] is None, entry
    else:
        assert (entry["output_tokens"], entry["exact"]) == expected, entry
