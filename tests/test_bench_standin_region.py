"""bench/standin_region.py for real: the region the global-overhead benchmark puts behind
the global tier in place of a Tier-1 gateway.

The stand-in is a real process and its real Envoy on a free loopback port, spoken to over
TLS as the global tier speaks to a region: HTTP/1.1 (the router's poller, aiohttp; wrk)
and HTTP/2 (the global tier's Envoy). Then the real global tier (`igw global serve`) with
the stand-in as its one region: the router finds it fresh and every request comes back from
it. The stand-in (and with it its Envoy) is stopped by PID when the module ends. No timing
is asserted.
"""

from __future__ import annotations

import http.client
import ssl
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import orjson
import pytest

from bench.echo_server import COMPLETION
from bench.overhead import MODEL
from bench.procs import Child, start_child, wait_log_line
from bench.standin_region import Summary, ca_file
from contract import headers as hdr
from globalrouter.poller import parse_summary
from igw.ports import free_ports
from tests.procs import global_config, global_router
from tests.test_global_support import status, wait_fresh

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}


@dataclass
class StandIn:
    child: Child
    port: int
    ca: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Iterator[StandIn]:
    tmp = tmp_path_factory.mktemp("standin")
    (port,) = free_ports(1)
    child = start_child("standin", [sys.executable, "-m", "bench.standin_region", "--port",
                                    str(port), "--state-dir", str(tmp)], tmp / "standin.log")
    try:
        wait_log_line(child, lambda line: line.startswith("standin-region ready"), 30)
        yield StandIn(child, port, ca_file(tmp))
    finally:
        child.stop()


def _client(standin: StandIn, http2: bool) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(standin.ca))
    return httpx.Client(base_url=standin.url, verify=context, http2=http2, timeout=10)


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "http2"])
def test_the_standin_answers_the_inference_post_and_the_load_summary(standin, http2):
    with _client(standin, http2) as http:
        answer = http.post("/v1/chat/completions", json=CHAT)
        assert answer.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert answer.status_code == 200 and answer.content == COMPLETION
        assert answer.headers["content-type"] == "application/json"
        big = http.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 300_000})
        assert big.status_code == 200 and big.content == COMPLETION  # many DATA frames
        first = http.get(hdr.LOAD_SUMMARY_PATH)
        second = http.get(hdr.LOAD_SUMMARY_PATH)
        assert http.get("/no-such-path").status_code == 404
    assert first.status_code == second.status_code == 200
    doc = parse_summary(first.content)  # what the router's poller accepts
    assert doc["serving"] is True
    (pool,) = doc["pools"]
    assert pool["model"] == MODEL and pool["readyPods"] == pool["pods"] == 1
    assert pool["saturated"] is False and pool["predictedTtftS"] > 0
    # the router counts a summary whose generation stopped moving as stale
    assert parse_summary(second.content)["generation"] > doc["generation"]


def test_an_http1_connection_is_kept_across_posts(standin):
    """wrk's direct measurement reuses its connection: an answer sent before the body
    was read would close it, and every request would pay a TLS handshake."""
    context = ssl.create_default_context(cafile=str(standin.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", standin.port, context=context, timeout=10)
    try:
        for _ in range(3):
            conn.request("POST", "/v1/chat/completions", body=orjson.dumps(CHAT),
                         headers={"content-type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 200 and answer.read() == COMPLETION
            assert not answer.will_close
    finally:
        conn.close()


async def test_the_poller_reads_it_as_it_reads_a_region(standin):
    """aiohttp over TLS verified with the region's CA, as globalrouter.poller does."""
    context = ssl.create_default_context(cafile=str(standin.ca))
    url = f"{standin.url}{hdr.LOAD_SUMMARY_PATH}"
    async with (aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session,
                session.get(url) as response):
        assert response.status == 200
        body = await response.read()
    assert parse_summary(body)["pools"][0]["model"] == MODEL


def test_the_global_tier_routes_every_request_through_the_standin(standin, tmp_path):
    region = {"name": "standin", "endpoint": f"127.0.0.1:{standin.port}",
              "caFile": str(standin.ca)}
    doc = global_config([region], models=[{"name": MODEL, "policy": "fastest"}])
    with global_router(tmp_path, doc) as router:
        wait_fresh(router, {"standin"})
        context = ssl.create_default_context(cafile=str(router.ca))
        with httpx.Client(base_url=router.url, verify=context, timeout=30) as http:
            answers = [http.post("/v1/chat/completions", json=CHAT) for _ in range(5)]
        (row,) = status(router)["regions"]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.headers[hdr.REGION] == "standin"
        assert answer.content == COMPLETION
        # answered by the stand-in's Envoy, not the Python process behind it
        assert answer.headers["x-sim-pod"] == "standin"
    assert row["name"] == "standin" and row["fresh"]


def test_each_summary_is_a_new_generation():
    summary = Summary("m")
    doc = orjson.loads(summary.body())
    assert parse_summary(summary.body())["generation"] == doc["generation"] + 1
