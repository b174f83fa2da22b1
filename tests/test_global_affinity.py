"""Session and prefix affinity per region (globalrouter.affinity) and how placement uses
them (globalrouter.placement), on hand-written load summaries; the config's bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bbr.prefix import prefix_hashes
from contract.config import ConfigError
from contract.errors import InvalidRequest
from contract.global_config import AffinityConfig, parse_global_config
from globalrouter.affinity import MAX_SESSION_CHARS, RegionAffinity
from globalrouter.placement import allow_list, place
from tests.test_global_placement import NOW, M, _feed, _table

NEAR, MID, FAR = 0, 1, 2


def _place(table, session_row=-1, cached=None, header=None):
    policy = table.config.policy_for(M)
    return place(table, M, table.views[M], policy, allow_list(table, header), NOW, 3, header,
                 session_row=session_row,
                 cached=None if cached is None else np.array(cached, dtype=float))


def test_a_session_keeps_its_region_over_a_cheaper_one():
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.10})
    assert _place(table).names[0] == "far"  # the cheapest within 500 ms
    kept = _place(table, session_row=NEAR)
    assert kept.names == ("near", "far", "mid") and kept.affinity == "session"


@pytest.mark.parametrize("why", ["saturated", "misses the SLO", "not allowed"])
def test_a_session_moves_when_its_region_no_longer_qualifies(why):
    table = _table()
    _feed(table, {"mid": 0.10, "far": 0.30}, {"far": 0.10})
    near = {"saturated": (0.05, {"saturated": True}), "misses the SLO": (0.60, {}),
            "not allowed": (0.05, {})}[why]
    _feed(table, {"near": near[0]}, **near[1])
    header = "mid,far" if why == "not allowed" else None
    moved = _place(table, session_row=NEAR, header=header)
    assert moved.names[0] == "far" and moved.affinity == "moved"
    assert why != "not allowed" or "near" not in moved.names  # a session never widens


def test_a_cached_prefix_shortens_the_prediction_and_wins_under_fastest():
    table = _table([{"name": M, "policy": "fastest", "ttftSlo": "1s"}])
    _feed(table, {"near": 0.20, "mid": 0.30, "far": 0.05}, {"near": 0.01, "far": 0.10})
    assert _place(table).names[0] == "far"  # 0.15 against 0.21
    hit = _place(table, cached=[0.8, 0.0, 0.0])  # near: 0.2 × 0.2 + 0.01 = 0.05
    assert hit.names[0] == "near" and hit.affinity == "prefix"
    assert math.isclose(hit.predicted_ttft_s, 0.05)


def test_a_cached_prefix_does_not_shorten_a_queue():
    table = _table([{"name": M, "policy": "fastest", "ttftSlo": "1s"}])
    _feed(table, {"far": 0.05}, {"far": 0.10})
    waiting = {"version": 1, "generation": 1, "serving": True, "pools": [{
        "model": M, "pods": 2, "readyPods": 2, "saturation": 0.5, "queueLength": 3,
        "predictedTtftS": 0.20}]}
    table.record_ok(NEAR, waiting, 0.01, NOW)
    assert _place(table, cached=[0.8, 0.0, 0.0]).names[0] == "far"


def test_a_prompt_every_region_may_hold_glues_nothing_under_cheapest():
    """A shared system prompt cached in the expensive region: the cheapest region that
    meets the SLO still wins (affinity makes the prediction better, it is not sticky)."""
    table = _table()
    _feed(table, {"near": 0.05, "mid": 0.10, "far": 0.30}, {"far": 0.10})
    assert _place(table, cached=[0.9, 0.0, 0.0]).names[0] == "far"


def test_a_cached_prefix_can_bring_a_cheap_region_within_the_slo():
    table = _table()
    _feed(table, {"near": 0.30, "mid": 0.45, "far": 0.60}, {"mid": 0.07, "far": 0.10})
    assert _place(table).names[0] == "near"  # far: 0.70 > 0.5 cold
    hit = _place(table, cached=[0.0, 0.0, 0.6])  # far: 0.60 × 0.4 + 0.10 = 0.34
    assert hit.names[0] == "far" and hit.meets_slo


def _prompt(chars: int) -> str:
    return "".join(chr(ord("a") + i % 26) for i in range(chars))


def test_the_matched_share_of_a_longer_turn():
    affinity = RegionAffinity(AffinityConfig(), 3)
    first = _prompt(640)
    affinity.record(None, prefix_hashes(M, first).tolist(), FAR, NOW)
    longer = first + "-next turn-" + _prompt(629)  # 1280 characters, the first 640 shared
    share = affinity.matched(prefix_hashes(M, longer).tolist(), len(longer))
    assert share.tolist() == [0.0, 0.0, 0.5]
    other = affinity.matched(prefix_hashes("other-model", longer).tolist(), len(longer))
    assert other is None  # the chain is seeded with the model: another model shares nothing
    assert affinity.matched([], 0) is None


def test_sessions_are_bounded_and_forgotten_when_idle():
    affinity = RegionAffinity(AffinityConfig(max_sessions=2, session_idle_timeout_s=60), 3)
    for i, session in enumerate(("a", "b", "c")):
        affinity.record(session, [], i, NOW + i)
    assert affinity.sessions == 2
    assert affinity.session_row("a", NOW + 3) == -1  # the least recently used went
    assert affinity.session_row("c", NOW + 3) == 2
    assert affinity.session_row("b", NOW + 62) == -1  # idle longer than the timeout
    affinity.record("d", [], 0, NOW + 200)  # expires the idle ones on the way
    assert affinity.sessions == 1
    assert affinity.session_row(None, NOW) == -1


def test_an_overlong_session_id_is_a_client_error():
    affinity = RegionAffinity(AffinityConfig(), 3)
    assert affinity.session_row("x" * MAX_SESSION_CHARS, NOW) == -1
    with pytest.raises(InvalidRequest) as err:
        affinity.session_row("x" * (MAX_SESSION_CHARS + 1), NOW)
    assert err.value.status == 400 and "x-session-id" in str(err.value)


def test_affinity_can_be_turned_off():
    affinity = RegionAffinity(AffinityConfig(prefix_blocks_per_region=0, max_sessions=0), 3)
    hashes = prefix_hashes(M, _prompt(640)).tolist()
    affinity.record("s", hashes, NEAR, NOW)
    assert affinity.session_row("s", NOW) == -1
    assert affinity.matched(hashes, 640) is None
    assert affinity.sessions == 0 and affinity.prefix_blocks == 0


def _config(affinity) -> dict:
    return {"apiVersion": "inference-gateway.io/v1alpha1", "kind": "GlobalRouterConfig",
            "spec": {"regions": [{"name": "a", "endpoint": "127.0.0.2:1"}],
                     "affinity": affinity}}


def test_affinity_config_defaults_and_values():
    assert parse_global_config(_config(None)).affinity == AffinityConfig()
    parsed = parse_global_config(_config(
        {"prefixBlocksPerRegion": 0, "maxSessions": 10, "sessionIdleTimeout": "5m"})).affinity
    assert parsed == AffinityConfig(prefix_blocks_per_region=0, max_sessions=10,
                                    session_idle_timeout_s=300.0)


@pytest.mark.parametrize(("affinity", "message"), [
    ({"maxSessions": -1}, "spec.affinity.maxSessions: must be between 0"),
    ({"prefixBlocksPerRegion": 10**9}, "spec.affinity.prefixBlocksPerRegion: must be between"),
    ({"maxSessions": "many"}, "spec.affinity.maxSessions: expected int"),
    ({"sessionIdleTimeout": "soon"}, "spec.affinity.sessionIdleTimeout: expected a duration"),
    ({"sessionHeader": "x-conv"}, "sessionHeader"),
])
def test_affinity_config_errors_name_the_field(affinity, message):
    with pytest.raises(ConfigError, match=message):
        parse_global_config(_config(affinity))


def test_with_a_prefill_speed_the_cached_tokens_come_off_at_that_speed():
    """A summary with the region's prefill speed: the matched share of THIS prompt is
    taken off at that speed (2,000 of 4,000 tokens at 10,000 tokens/s: 0.2 s less)."""
    table = _table([{"name": M, "policy": "fastest", "ttftSlo": "5s"}])
    for name, rtt in (("near", 0.01), ("far", 0.10)):
        summary = {"version": 1, "generation": 1, "serving": True, "pools": [{
            "model": M, "pods": 1, "readyPods": 1, "saturation": 0.1, "predictedTtftS": 0.10,
            "typicalPromptTokens": 500, "prefillTokensPerS": 10_000}]}
        table.record_ok(table.index[name], summary, rtt, NOW)
    policy = table.config.policy_for(M)
    cold = place(table, M, table.views[M], policy, None, NOW, 3, prompt_tokens=4000)
    assert cold.names[0] == "near" and math.isclose(cold.predicted_ttft_s, 0.10 + 0.35 + 0.01)
    warm = place(table, M, table.views[M], policy, None, NOW, 3, prompt_tokens=4000,
                 cached=np.array([0.0, 0.0, 0.5]))
    assert warm.names[0] == "far" and warm.affinity == "prefix"
    assert math.isclose(warm.predicted_ttft_s, 0.10 + 0.35 - 0.20 + 0.10)
