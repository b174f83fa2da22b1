"""Fair shares across two coordinated gateway replicas (real Redis, two `igw serve`).

tests/test_fairness.py's criterion, with the noisy tenant's traffic split over two
replicas in front of the same pods, as an NLB spreads it, and the quiet tenant on one
of them. Each replica counts the other's requests of a tenant in that tenant's share
of the pool's slots (the tenant rides with every shared dispatch,
picker.coordination.codec `dt`); without that, each replica would give the noisy
tenant its whole share and together they would give it twice as much, and the quiet
tenant's requests would wait behind it in the engines' queues.

    pytest tests/test_fairness_replicas.py -s -m slow
"""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.procs import gateway, gateway_config, mint_key, sim_fleet
from tests.test_coordination_support import redis_server
from tests.test_fairness import (
    DURATION_S,
    NOISE_S,
    PODS,
    SLOTS,
    _body,
    _load,
    _p95_ttft,
    rates,
)
from tests.test_reliability_support import Figures, Load

pytestmark = pytest.mark.slow

MODEL = PODS[0]["model"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fairness-replicas")
    keys_file = tmp / "keys"
    keys = {name: mint_key(keys_file, name) for name in ("quiet", "noisy")}
    with redis_server() as redis, sim_fleet(tmp, PODS, time_scale=1.0) as fleet:
        coordination = {"url": redis.url, "keyPrefix": f"igw-fair-{time.monotonic_ns()}",
                        "heartbeatInterval": "200ms", "replicaTimeout": "1s"}

        def config() -> dict:
            return gateway_config(
                [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses(),
                  "saturation": {"queueSize": 64, "queueTimeout": "5s"}}],
                tenants={"keysFile": str(keys_file),
                         "list": [{"name": "quiet"}, {"name": "noisy"}]},
                coordination=coordination,
            )

        with contextlib.ExitStack() as stack_:
            gws = [stack_.enter_context(gateway(tmp, config())) for _ in range(2)]
            yield gws, keys


def test_a_noisy_tenant_on_two_replicas_leaves_the_quiet_one_within_20_percent(stack):
    (gw_a, gw_b), keys = stack
    figures = Figures("fairness_replicas")
    quiet = {"authorization": f"Bearer {keys['quiet']}"}
    # warm: both replicas learn the pods' slots from one burst's queues (shared scrapes)
    for gw in (gw_a, gw_b):
        teach = Load(gw.url, gw.ca, rate=200, duration=3 * len(PODS) * SLOTS / 200,
                     body=_body, stream=True, headers=quiet).in_thread().result(60)
        assert not teach.failed(), teach.summary()
    quiet_rate, noisy_rate = rates(gw_a, keys["quiet"], figures)

    alone = _load(gw_a, keys["quiet"], quiet_rate).result(DURATION_S + 60)
    assert not alone.failed(), alone.summary()
    noisy_futures = [_load(gw, keys["noisy"], noisy_rate / 2) for gw in (gw_a, gw_b)]
    together = _load(gw_a, keys["quiet"], quiet_rate).result(DURATION_S + 60)
    noisy = [f.result(DURATION_S + 60) for f in noisy_futures]

    figures["quiet_alone_p95_ttft_s"] = round(_p95_ttft(alone), 3)
    figures["quiet_with_noisy_p95_ttft_s"] = round(_p95_ttft(together), 3)
    figures["noisy_statuses"] = [dict(n.statuses()) for n in noisy]
    figures.emit()
    assert not together.failed(), together.summary()
    outcomes = [o for n in noisy for o in n.outcomes]
    assert sum(o.status == 200 for o in outcomes) < 0.5 * len(outcomes), figures
    assert not [o for o in outcomes if o.status == 0], "client timeouts"
    assert _p95_ttft(together) <= max(1.2 * _p95_ttft(alone), _p95_ttft(alone) + NOISE_S), figures
