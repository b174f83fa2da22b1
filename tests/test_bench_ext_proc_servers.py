"""The ext_proc server benchmark's harness (bench/ext_proc_servers.py): each do-nothing
stub answers a real Envoy-forwarded request, on the one-message and the two-message path;
and the summary pairs each point with the same round's baseline.

One request per case and no timing: speed is what `igw bench --ext-proc-servers`
measures, never a test. wrk is not needed here (urllib sends the request).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from bench.ext_proc_servers import (
    echo_backend,
    ext_proc_stats,
    post,
    rotated,
    running,
    summarize,
    verdict,
)
from bench.ext_proc_stubs import STUBS
from bench.overhead import _body
from igw_envoy.binary import EnvoyNotFoundError, find_envoy


def _missing() -> str | None:
    if importlib.util.find_spec("grpclib") is None:
        return "grpclib is not installed (a benchmark dependency: pip install grpclib)"
    try:
        find_envoy()
    except EnvoyNotFoundError as exc:
        return str(exc)
    return None


needs_servers = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    work = tmp_path_factory.mktemp("ext-proc-servers")
    with echo_backend(work) as port:
        yield work, port


@needs_servers
@pytest.mark.parametrize("messages", [1, 2])
@pytest.mark.parametrize("stub", STUBS)
def test_stub_answers_a_request_through_envoy(echo, stub, messages):
    work, port = echo
    with running(stub, work, port, messages) as run:
        status, body = post(run.url, _body().encode())
        stats = ext_proc_stats(run.admin_port)
    assert status == 200, body
    assert json.loads(body)["object"] == "chat.completion"  # the echo backend answered
    # The request went through the stub (fail-closed, so no answer would be a 503):
    # one stream, and one answer per message the path sends.
    assert stats["streams_started"] == 1
    assert stats["stream_msgs_sent"] == messages
    assert stats["stream_msgs_received"] == messages
    assert stats["streams_failed"] == 0
    assert stats["failure_mode_allowed"] == 0


def _point(rps: float, p50: float, stub: float | None, envoy: float) -> dict:
    cpu = {"envoy": envoy} if stub is None else {"stub": stub, "envoy": envoy}
    return {"requests": int(rps), "errors": 0, "rps": rps, "p50_ms": p50, "p99_ms": 2 * p50,
            "cpu_ms": cpu}


def test_every_target_starts_a_round_once():
    targets = ["envoy", "grpc-aio", "grpclib", "h2-grpc"]
    firsts = [rotated(targets, r)[0] for r in range(4)]
    assert sorted(firsts) == sorted(targets)
    assert all(sorted(rotated(targets, r)) == sorted(targets) for r in range(4))


def test_summary_pairs_each_round_with_its_baseline_and_names_the_winner():
    # Round 2 is slow for everyone (a loaded machine): paired differences stay put.
    samples = {
        "envoy": {1: [_point(4000, 0.2, None, 0.15), _point(2000, 0.4, None, 0.3)]},
        "grpc-aio": {1: [_point(1000, 0.7, 0.40, 0.3), _point(500, 0.9, 0.50, 0.6)]},
        "grpclib": {1: [_point(1200, 0.6, 0.35, 0.3), _point(600, 0.8, 0.45, 0.6)]},
        "h2-grpc": {1: [_point(2000, 0.3, 0.05, 0.25), _point(1000, 0.5, 0.06, 0.5)]},
    }
    summary = summarize(samples)
    ours = summary["h2-grpc"][1]
    assert ours["added_p50_ms"] == pytest.approx(0.1)
    assert ours["rps_vs_baseline"] == pytest.approx(0.5)
    assert ours["stub_cpu_ms"] == pytest.approx(0.055)
    assert ours["envoy_cpu_vs_baseline"] == pytest.approx(25 / 15)
    assert summary["envoy"][1]["added_p50_ms"] == pytest.approx(0.0)
    (line,) = verdict(summary)
    assert "h2-grpc wins on CPU, throughput, added latency" in line
    assert "grpc-aio 0.450 ms (8.2× ours)" in line
