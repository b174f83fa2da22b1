"""The benchmark's two limit designs really limit: each behind the real Envoy, with the
real redis-server, at two requests per minute, answers 200, 200, then 429.

bench/ratelimit.py measures them with a limit nothing reaches; this is what keeps that
measurement honest: (a) is a working rate-limit service that Envoy's filter obeys,
(b) the product's limiter in the ext_proc path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.ext_proc_servers import echo_backend, post
from bench.overhead import _body
from bench.ratelimit import redis, running, with_rate_limit_service

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed")


@pytest.mark.parametrize("target", ["rls", "picker"])
def test_each_design_refuses_the_third_request(tmp_path: Path, target: str) -> None:
    body = _body().encode()
    with echo_backend(tmp_path) as echo_port, redis(tmp_path) as redis_child, \
            running(target, tmp_path, echo_port, redis_child, limit=2) as run:
        statuses = [post(run.url, body)[0] for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_the_baseline_and_a_high_limit_refuse_nothing(tmp_path: Path) -> None:
    body = _body().encode()
    with echo_backend(tmp_path) as echo_port, redis(tmp_path) as redis_child:
        for target in ("none", "rls", "picker"):
            with running(target, tmp_path, echo_port, redis_child) as run:
                assert [post(run.url, body)[0] for _ in range(3)] == [200] * 3, target


def test_rate_limit_filter_goes_first_and_every_route_sends_the_descriptor() -> None:
    from bench.ext_proc_servers import bootstrap

    config = with_rate_limit_service(bootstrap(1, 2, 3, 4, 1), 5)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert hcm["http_filters"][0]["name"] == "envoy.filters.http.ratelimit"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert len(routes) == 2 and all(r["route"]["rate_limits"] for r in routes)
    assert any(c["name"] == "rls" for c in config["static_resources"]["clusters"])
