"""The global router's per-request TTFT prediction (globalrouter.placement.predict):
this request's own prompt, the work the router placed since the last summary, the SLO
headroom; on hand-written load summaries, as tests/test_global_placement.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from globalrouter.director import GlobalDirector
from globalrouter.placement import SLO_HEADROOM, allow_list, place, predict
from globalrouter.regions import RegionTable
from picker.director import RequestInfo
from tests.test_global_placement import NOW, M, _summary, _table

SLO = 0.5  # the tables' cheapest-within-slo SLO


def _speedy(ttft: float, tps: float, typical: int = 400, generation: int = 1,
            ready: int = 2) -> dict:
    """A summary with the prefill speed and typical prompt the prediction scales by."""
    summary = _summary(ttft, generation=generation, ready=ready)
    summary["pools"][0].update(prefillTokensPerS=tps, typicalPromptTokens=typical)
    return summary


def _world(far_ttft: float = 0.30, now: float = NOW) -> RegionTable:
    """near: fast and dear; mid; far: cheap, slow prefill (1,000 tokens/s), 100 ms away."""
    table = _table()
    for name, ttft, tps, rtt in (("near", 0.05, 20_000, 0.01), ("mid", 0.10, 8_000, 0.07),
                                 ("far", far_ttft, 1_000, 0.10)):
        table.record_ok(table.index[name], _speedy(ttft, tps), rtt, now)
    return table


def _place(table: RegionTable, prompt_tokens: int | None):
    policy = table.config.policy_for(M)
    return place(table, M, table.views[M], policy, allow_list(table, None), NOW, 3, None,
                 prompt_tokens)


def _rows(table: RegionTable) -> np.ndarray:
    return np.arange(len(table))


def test_a_prompt_longer_than_typical_costs_its_extra_tokens_at_the_regions_speed():
    table = _world()
    got = predict(table, M, table.views[M], _rows(table), 900)
    # 500 tokens over the typical 400: near +25 ms, mid +62.5 ms, far +500 ms; then RTT
    assert got == pytest.approx([0.05 + 0.025 + 0.01, 0.10 + 0.0625 + 0.07,
                                 0.30 + 0.5 + 0.10])


def test_a_long_prompt_leaves_the_slow_cheap_region_a_short_one_stays():
    table = _world()
    assert _place(table, 200).names[0] == "far"  # 0.30 - 0.2 + 0.10 = 0.2 s
    assert _place(table, 400).names[0] == "far"  # the typical request: 0.40 s
    assert _place(table, 900).names[0] == "mid"  # far would be 0.9 s


def test_a_short_prompt_never_predicts_less_than_the_rtt():
    table = _world()
    got = predict(table, M, table.views[M], _rows(table), 1)
    assert (got >= table.rtt_s).all()
    assert got[table.index["far"]] == pytest.approx(0.10)  # 0.30 - 0.399 s: clamped at 0


def test_without_a_prefill_speed_the_typical_prediction_is_used():
    """An older Tier 1 (no prefillTokensPerS): the summary's figure + RTT, as before."""
    table = _table()
    table.record_ok(table.index["far"], _summary(0.30), 0.10, NOW)
    got = predict(table, M, table.views[M], np.array([table.index["far"]]), 5_000)
    assert got == pytest.approx([0.40])


def test_work_placed_since_the_poll_left_counts_until_a_summary_shows_it():
    table = _world()
    far = table.index["far"]
    before = predict(table, M, table.views[M], _rows(table), 400)[far]
    for _ in range(3):
        table.note_placed(M, far, 400)
    # 1,200 tokens over its 2 ready pods at 1,000 tokens/s: +0.6 s
    assert predict(table, M, table.views[M], _rows(table), 400)[far] == pytest.approx(
        before + 0.6)
    assert _place(table, 400).names[0] == "mid"
    table.poll_sent(far, NOW)  # this poll's summary will show those three
    table.note_placed(M, far, 400)  # this one it may not
    table.record_ok(far, _speedy(0.30, 1_000, generation=2), 0.10, NOW)
    assert table.pending_tokens(M)[far] == pytest.approx(400)
    assert predict(table, M, table.views[M], _rows(table), 400)[far] == pytest.approx(
        before + 0.2)


def test_a_failed_poll_keeps_the_placed_work():
    table = _world()
    far = table.index["far"]
    table.note_placed(M, far, 1_000)
    table.poll_sent(far, NOW)
    table.record_failure(far, "TimeoutError", definite=False)
    assert table.pending_tokens(M)[far] == pytest.approx(1_000)


def test_the_director_notes_each_placement_on_its_first_region():
    table = _world(now=time.monotonic())  # the director places on its own clock
    director = GlobalDirector(table.config, table)
    body = b'{"model": "llama", "messages": [{"role": "user", "content": "' + b"x" * 3996 + b'"}]}'
    info = RequestInfo(path="/v1/chat/completions", content_type="application/json")
    decision = director.route_now(body, info)
    row = table.index[decision.region]
    pending = table.pending_tokens(M)
    assert pending[row] > 1_000 and pending.sum() == pending[row]


def test_a_region_predicted_just_inside_the_slo_but_within_the_headroom_is_not_cheapest():
    edge = SLO * (1 - SLO_HEADROOM / 2) - 0.10  # far's TTFT so that it lands in the headroom
    table = _world(far_ttft=edge)
    placed = _place(table, 400)
    assert placed.names[0] == "mid"
    table = _world(far_ttft=SLO * (1 - SLO_HEADROOM) - 0.10 - 0.01)
    assert _place(table, 400).names[0] == "far"
