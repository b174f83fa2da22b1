"""bench.global_soak's request mix and verdict (no processes: the 10-minute run itself is
`python -m bench.global_soak`, its result bench/results/global-soak.md)."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from bench.global_soak import (
    BODY_LIMIT,
    EXPECTED,
    MIX,
    RSS_BOUND_MIB,
    Outcome,
    _kinds,
    _request,
    _verdict,
)
from contract import headers as hdr


def test_the_mix_is_seeded_and_close_to_its_shares():
    kinds = _kinds(4000)
    assert kinds == _kinds(4000)
    counts = Counter(kinds)
    for kind, share in MIX.items():
        assert counts[kind] / 4000 == pytest.approx(share, abs=0.03), kind


def test_each_bad_kind_is_what_it_says():
    malformed, _ = _request("malformed", 1)
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(malformed)
    assert orjson.loads(_request("unknown", 2)[0])["model"] == "no-such-model"
    assert len(_request("oversized", 3)[0]) > BODY_LIMIT
    assert orjson.loads(_request("drop", 4)[0])["stream"] is True
    assert _request("allow", 5)[1] == {hdr.REGIONS: "us-east-1,us-west-2"}
    assert set(EXPECTED) == {"malformed", "unknown", "oversized"}


def _samples(router_growth: float, n: int = 60) -> list[dict]:
    return [{"t": 10.0 * i, "router_rss_mib": 80.0 + router_growth * i / n,
             "envoy_rss_mib": 70.0, "router_fds": 20, "envoy_fds": 40,
             "placed_keys": 1, "refused_keys": 2} for i in range(n)]


def _outcomes(**override: Outcome) -> list[Outcome]:
    good = [Outcome("chat", 200, True), Outcome("stream", 200, True)]
    bad = [Outcome("malformed", 400), Outcome("unknown", 404), Outcome("oversized", 413),
           Outcome("drop", 200)]
    return good + bad + list(override.values())


def test_a_flat_run_passes():
    doc = _verdict(_outcomes(), _samples(0.5), 0, 10, 4)
    assert doc["passed"], doc["checks"]


def test_memory_growing_in_the_second_half_fails():
    doc = _verdict(_outcomes(), _samples(4 * RSS_BOUND_MIB["router"]), 0, 10, 4)
    assert not doc["passed"]
    assert not doc["checks"]["router RSS growth (second half) < 8 MiB"]


@pytest.mark.parametrize("extra, check", [
    (Outcome("chat", 0, error="ServerDisconnectedError"), "0 failed good requests"),
    (Outcome("stream", 200, False), "0 failed good requests"),
    (Outcome("malformed", 503), "0 5xx for bad client input"),
    (Outcome("unknown", 400), "every bad input its 4xx"),
])
def test_a_failed_good_request_or_a_wrong_answer_to_bad_input_fails(extra, check):
    doc = _verdict(_outcomes(x=extra), _samples(0.0), 0, 10, 4)
    assert not doc["checks"][check] and not doc["passed"]
