"""Speed learning from counter deltas: the pure estimates and the row updates."""

from __future__ import annotations

import math

import pytest

from picker.datalayer.engines import SGLANG, TRTLLM, VLLM, Signal
from picker.datalayer.parser import MetricsSnapshot, parse_metrics
from picker.datalayer.speed import (
    SpeedLearner,
    counter_deltas,
    ewma,
    observation_weight,
    prefill_rate,
    window_mean,
)
from picker.datastore import PodTable
from simulator.standin_pages import PodState, render, render_vllm


def test_counter_deltas_plain_growth() -> None:
    assert counter_deltas((10.0, 4.0), (7.0, 3.0)) == (3.0, 1.0)
    assert counter_deltas((5.0, 2.0), (5.0, 2.0)) == (0.0, 0.0)


def test_counter_deltas_reset_uses_current_values_for_the_whole_group() -> None:
    # the count went down: the pod restarted, so the sum restarted too even if it
    # happens to be larger than before
    assert counter_deltas((50.0, 2.0), (40.0, 10.0)) == (50.0, 2.0)
    assert counter_deltas((0.0, 0.0), (40.0, 10.0)) == (0.0, 0.0)


def test_window_mean() -> None:
    assert window_mean(2.0, 4.0) == 0.5
    assert window_mean(1.0, 0.0) is None
    assert window_mean(-1.0, 2.0) is None
    assert window_mean(math.inf, 2.0) is None


def test_prefill_rate() -> None:
    assert prefill_rate(1000.0, 0.5) == 2000.0
    assert prefill_rate(0.0, 0.5) is None
    assert prefill_rate(100.0, 0.0) is None
    assert prefill_rate(-5.0, 1.0) is None


def test_observation_weight_grows_with_observations() -> None:
    assert observation_weight(0, 0.1) == 0.0
    assert observation_weight(1, 0.1) == pytest.approx(0.1)
    assert observation_weight(2, 0.1) == pytest.approx(0.19)
    assert observation_weight(1000, 0.1) == pytest.approx(1.0)


def test_ewma() -> None:
    assert ewma(0.0, 3.0, 0.1) == 3.0  # no estimate yet: take the sample
    assert ewma(math.nan, 3.0, 0.1) == 3.0
    assert ewma(1.0, 3.0, 0.5) == 2.0
    assert ewma(1.0, 3.0, 0.0) == 1.0


def _snap(state: PodState) -> MetricsSnapshot:
    return parse_metrics(render_vllm(state, extras=False), VLLM)


def test_learner_first_scrape_takes_the_lifetime_means() -> None:
    table, learner, state = PodTable(4), SpeedLearner(alpha=0.1), PodState()
    state.finish(10, prompt_tokens=1000, prefill_s=0.1, queue_s=0.05, itl_s=0.02,
                 output_tokens=11)
    learner.update(table, 2, _snap(state))
    assert table.ttft_s[2] == pytest.approx(0.15)
    assert table.queue_s[2] == pytest.approx(0.05)
    assert table.decode_step_s[2] == pytest.approx(0.02)
    assert table.prefill_tps[2] == pytest.approx(10000.0)
    assert table.raw_prefill_tokens[2] == 10000
    assert table.ttft_s[1] == 0.0  # other rows untouched


def test_learner_moves_towards_recent_windows_by_observation_count() -> None:
    table, learner, state = PodTable(4), SpeedLearner(alpha=0.1), PodState()
    state.finish(10, 1000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, _snap(state))
    state.finish(1, 1000, prefill_s=0.3, queue_s=0.0, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, _snap(state))
    # one observation of 0.3 s TTFT: weight 0.1
    assert table.ttft_s[0] == pytest.approx(0.1 + 0.1 * (0.3 - 0.1))
    # one request of 1000 tokens in 0.3 s
    assert table.prefill_tps[0] == pytest.approx(10000 + 0.1 * (1000 / 0.3 - 10000))
    # decode: 10 intervals at the same speed leave the estimate where it was
    assert table.decode_step_s[0] == pytest.approx(0.02)


def test_learner_idle_windows_change_nothing() -> None:
    table, learner, state = PodTable(2), SpeedLearner(), PodState()
    state.finish(5, 500, prefill_s=0.05, queue_s=0.01, itl_s=0.03, output_tokens=5)
    learner.update(table, 0, _snap(state))
    before = (table.ttft_s[0], table.prefill_tps[0], table.decode_step_s[0], table.queue_s[0])
    for _ in range(5):
        learner.update(table, 0, _snap(state))
    assert (table.ttft_s[0], table.prefill_tps[0], table.decode_step_s[0],
            table.queue_s[0]) == before


def test_learner_counter_reset_gives_no_negative_or_garbage_rates() -> None:
    table, learner, state = PodTable(2), SpeedLearner(alpha=0.5), PodState()
    state.finish(100, 2000, prefill_s=0.2, queue_s=0.1, itl_s=0.05, output_tokens=21)
    learner.update(table, 0, _snap(state))
    state.restart()  # pod restarted: every counter back to zero ...
    learner.update(table, 0, _snap(state))
    assert table.ttft_s[0] == pytest.approx(0.3)  # ... an empty window changes nothing
    state.finish(2, 2000, prefill_s=0.4, queue_s=0.1, itl_s=0.05, output_tokens=21)
    learner.update(table, 0, _snap(state))
    for column in ("ttft_s", "prefill_tps", "decode_step_s", "queue_s"):
        value = getattr(table, column)[0]
        assert math.isfinite(value) and value > 0, column
    assert table.ttft_s[0] == pytest.approx(0.3 + 0.75 * (0.5 - 0.3))
    assert table.prefill_tps[0] == pytest.approx(10000 + 0.75 * (5000 - 10000))


def test_learner_restart_with_counts_already_past_the_old_values() -> None:
    """A restart between scrapes that already served more than before still reads as new."""
    table, learner, state = PodTable(2), SpeedLearner(alpha=0.5), PodState()
    state.finish(3, 100, prefill_s=0.1, queue_s=0.0, itl_s=0.01, output_tokens=2)
    learner.update(table, 0, _snap(state))
    state.restart()
    state.finish(2, 100, prefill_s=1.0, queue_s=0.0, itl_s=0.01, output_tokens=2)
    learner.update(table, 0, _snap(state))
    # count 3 -> 2 is a reset: the window is the 2 new requests (mean 1.0 s)
    assert table.ttft_s[0] == pytest.approx(0.1 + 0.75 * (1.0 - 0.1))


def test_learner_missing_series_leave_estimates_alone() -> None:
    table, learner = PodTable(2), SpeedLearner()
    table.ttft_s[0] = 0.5
    learner.update(table, 0, MetricsSnapshot(values={Signal.WAITING: 1.0}))
    assert table.ttft_s[0] == 0.5
    assert table.raw_ttft_count[0] == 0.0


def test_prefill_falls_back_to_the_prompt_token_counter() -> None:
    """A prefill histogram beside only the running prompt-token counter still gives a rate.

    No profile reads that pair today (SGLang has no prefill histogram, Triton's
    TensorRT-LLM backend none at all), so the snapshot is written out directly.
    """
    table, learner = PodTable(2), SpeedLearner()
    snap = MetricsSnapshot(values={Signal.PREFILL_TIME_SUM: 0.8, Signal.PREFILL_TIME_COUNT: 4.0,
                                   Signal.PROMPT_TOKENS: 1600.0})
    learner.update(table, 1, snap)
    assert table.prefill_tps[1] == pytest.approx(2000.0)


def test_triton_trtllm_page_gives_the_learner_nothing() -> None:
    """Triton's TensorRT-LLM backend exports no latency histograms or token counters."""
    table, learner, state = PodTable(2), SpeedLearner(), PodState()
    state.finish(4, 400, prefill_s=0.2, queue_s=0.0, itl_s=0.01, output_tokens=3)
    learner.update(table, 1, parse_metrics(render("trtllm", state), TRTLLM))
    assert table.prefill_tps[1] == PodTable(2).prefill_tps[1]
    assert table.raw_ttft_count[1] == 0.0



def test_the_speed_of_uncached_prompt_tokens_is_learned_beside_the_speed() -> None:
    """vLLM counts a request's cached prefix in its prompt tokens, though it costs no
    prefill time; its prefix-cache counters say how much of the prompts that was."""
    table, learner = PodTable(2), SpeedLearner(alpha=0.1)
    cold, hot = PodState(), PodState()
    for _ in range(5):
        cold.finish(4, 1000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11)
        hot.finish(4, 4000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11,
                   cached_tokens=3000)
        learner.update(table, 0, _snap(cold))
        learner.update(table, 1, _snap(hot))
    assert table.prefill_tps.tolist() == pytest.approx([10000.0, 40000.0])  # as counted
    assert table.prefill_tps_uncached.tolist() == pytest.approx([10000.0, 10000.0])


def test_hits_counted_at_scheduling_meet_the_prompt_tokens_counted_later() -> None:
    """The engine counts a cache hit when it schedules a request and its prompt tokens
    when its prefill (or the request) ends, windows later. After an idle gap, when the
    one window replaces the learned speed, that request's hits must still be in it."""
    table, learner = PodTable(1), SpeedLearner(alpha=0.1)
    state = PodState()
    state.finish(2, 1000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, _snap(state), now=1.0)
    state.prefix_queries += 4000  # a hot request scheduled: 3,000 of its tokens cached
    state.prefix_hits += 3000
    learner.update(table, 0, _snap(state), now=10.0)
    learner.update(table, 0, _snap(state), now=10.1)  # still prefilling
    state.finish(1, 4000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11,
                 cached_tokens=3000)
    state.prefix_queries -= 4000  # its lookups at the end are the ones counted above
    state.prefix_hits -= 3000
    learner.update(table, 0, _snap(state), now=10.2)  # 9.2 s after the last: replaces
    assert table.prefill_tps[0] == pytest.approx(40000.0)
    assert table.prefill_tps_uncached[0] == pytest.approx(10000.0)
    assert table.pending_cache_queries[0] == 0.0 and table.pending_cache_hits[0] == 0.0


def test_a_page_without_prefix_cache_counters_counts_every_prompt_token() -> None:
    table, learner = PodTable(1), SpeedLearner()
    snap = MetricsSnapshot(values={Signal.PREFILL_TIME_SUM: 0.8, Signal.PREFILL_TIME_COUNT: 4.0,
                                   Signal.FINISHED_PROMPT_TOKENS: 1600.0})
    learner.update(table, 0, snap)
    assert table.prefill_tps[0] == table.prefill_tps_uncached[0] == pytest.approx(2000.0)


def test_a_restart_drops_the_lookups_still_pending() -> None:
    table, learner, state = PodTable(1), SpeedLearner(alpha=0.5), PodState()
    state.prefix_queries, state.prefix_hits = 5000.0, 4000.0  # scheduled, never prefilled
    learner.update(table, 0, _snap(state))
    state.restart()
    state.finish(1, 1000, prefill_s=0.1, queue_s=0.0, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, _snap(state))
    assert table.prefill_tps_uncached[0] == pytest.approx(10000.0)  # not 2,000


def test_vllm_0_8_prefix_cache_counters_are_read_under_their_old_names() -> None:
    """vLLM 0.8 exported only the gpu_-prefixed counters (the fixture's header and TYPE
    lines); 0.10 both, the new ones first."""
    from picker.datalayer.parser import parse_metrics as parse

    page = (
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0\n"
        "# TYPE vllm:gpu_prefix_cache_queries counter\nvllm:gpu_prefix_cache_queries_total 50\n"
        "# TYPE vllm:gpu_prefix_cache_hits counter\nvllm:gpu_prefix_cache_hits_total 20\n"
    )
    values = parse(page, VLLM).values
    assert values[Signal.PREFIX_QUERIES] == 50.0
    assert values[Signal.PREFIX_HITS] == 20.0


def test_sglang_prefill_speed_is_ttft_less_queue_time() -> None:
    """SGLang exports no prefill-time histogram, but TTFT and queue time: their
    difference is the prefill (and first step) vLLM's histogram measures."""
    table, learner, state = PodTable(1), SpeedLearner(alpha=0.5), PodState()
    state.finish(4, 1000, prefill_s=0.1, queue_s=0.3, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, parse_metrics(render("sglang", state), SGLANG))
    assert table.prefill_tps[0] == pytest.approx(10000.0)
    state.finish(4, 1000, prefill_s=0.2, queue_s=0.0, itl_s=0.02, output_tokens=11)
    learner.update(table, 0, parse_metrics(render("sglang", state), SGLANG))
    # decayed sums: 4 requests in 0.4 s kept at 0.5^4, then 4 more in 0.8 s
    assert table.prefill_tps[0] == pytest.approx(1000 * (4 * 0.5**4 + 4) / (0.4 * 0.5**4 + 0.8))


def test_sglang_first_tokens_count_at_the_mean_prompt_of_finished_requests() -> None:
    """SGLang's prompt counter grows when a request finishes: a window of first tokens and
    no finishes still says how fast the pod prefilled, at the finished requests' mean
    prompt (prompt counter over the end-to-end histogram's count)."""
    table, learner = PodTable(1), SpeedLearner(alpha=0.5)
    page = {Signal.TTFT_SUM: 1.0, Signal.TTFT_COUNT: 4.0, Signal.QUEUE_TIME_SUM: 0.6,
            Signal.QUEUE_TIME_COUNT: 4.0, Signal.FINISHED_PROMPT_TOKENS: 4000.0,
            Signal.FINISHED_REQUESTS: 4.0}
    learner.update(table, 0, MetricsSnapshot(values=dict(page)))
    assert table.prefill_tps[0] == pytest.approx(10000.0)  # 4 x 1,000 tokens in 0.4 s
    page.update({Signal.TTFT_SUM: 1.5, Signal.TTFT_COUNT: 6.0, Signal.QUEUE_TIME_SUM: 0.7,
                 Signal.QUEUE_TIME_COUNT: 6.0})  # two first tokens, 0.4 s of prefill
    learner.update(table, 0, MetricsSnapshot(values=dict(page)))
    # 4 requests in 0.4 s kept at 0.5^2, then 2 more in 0.4 s
    assert table.prefill_tps[0] == pytest.approx(1000 * (4 * 0.25 + 2) / (0.4 * 0.25 + 0.4))


def test_sglang_windows_are_priced_at_the_latest_mean_prompt() -> None:
    """The mean prompt of finished requests is read from a few requests at first; a
    window priced at it once kept that price, and a pod read slow from an early window
    was avoided and never corrected (family-0-9). Every kept window takes the latest."""
    table, learner = PodTable(1), SpeedLearner(alpha=0.5)
    page = {Signal.TTFT_SUM: 1.0, Signal.TTFT_COUNT: 4.0, Signal.QUEUE_TIME_SUM: 0.6,
            Signal.QUEUE_TIME_COUNT: 4.0, Signal.FINISHED_PROMPT_TOKENS: 4000.0,
            Signal.FINISHED_REQUESTS: 4.0}
    learner.update(table, 0, MetricsSnapshot(values=dict(page)))
    assert table.prefill_tps[0] == pytest.approx(10000.0)
    page.update({Signal.TTFT_SUM: 1.5, Signal.TTFT_COUNT: 6.0, Signal.QUEUE_TIME_SUM: 0.7,
                 Signal.QUEUE_TIME_COUNT: 6.0, Signal.FINISHED_PROMPT_TOKENS: 16000.0,
                 Signal.FINISHED_REQUESTS: 8.0})  # the mean prompt is 2,000 now
    learner.update(table, 0, MetricsSnapshot(values=dict(page)))
    # 3 requests (4 kept at 0.25, 2 new) in 0.5 s, all at 2,000 tokens; an EWMA of the
    # windows as priced when they came would have stayed at 10,000
    assert table.prefill_tps[0] == pytest.approx(12000.0)


def test_no_derived_prefill_when_ttft_and_queue_time_count_other_requests() -> None:
    table, learner = PodTable(1), SpeedLearner()
    snap = MetricsSnapshot(values={Signal.TTFT_SUM: 1.0, Signal.TTFT_COUNT: 5.0,
                                   Signal.QUEUE_TIME_SUM: 0.2, Signal.QUEUE_TIME_COUNT: 6.0,
                                   Signal.PROMPT_TOKENS: 5000.0})
    learner.update(table, 0, snap)
    assert table.prefill_tps[0] == 0.0


# -- the step length from TensorRT-LLM's iteration counter -------------------------------

def _trtllm(table: PodTable, learner: SpeedLearner, state: PodState, at: float) -> None:
    learner.update(table, 1, parse_metrics(render("trtllm", state), TRTLLM), at)


def test_step_length_is_time_between_counter_moves_over_the_steps_run() -> None:
    """TensorRT-LLM admits what it has room for into the next step, so its load shows as
    longer steps: 40 ms steps, then 200 ms ones (a burst's prefill in every step)."""
    table, learner, state = PodTable(2), SpeedLearner(), PodState(running=3.0)
    for i in range(10):
        state.iterations = 1000 + 5 * i
        _trtllm(table, learner, state, 100.0 + 0.2 * i)
    assert table.iteration_s[1] == pytest.approx(0.04)
    for i in range(10, 20):
        state.iterations = 1045 + (i - 9)
        _trtllm(table, learner, state, 100.0 + 0.2 * i)
    assert table.iteration_s[1] == pytest.approx(0.2, rel=0.01)
    assert table.prefill_tps[1] == PodTable(2).prefill_tps[1]  # no speed learned from it


def test_a_counter_refreshed_every_two_seconds_gives_the_step_not_the_refresh() -> None:
    """Triton refreshes its metrics on its own interval (2 s by default): scraped every
    50 ms, the counter stands still for 40 scrapes and then jumps. Read between moves,
    the steps are 50 ms; read between scrapes, 40 of 41 windows showed no step at all."""
    table, learner, state = PodTable(2), SpeedLearner(), PodState(running=4.0)
    for k in range(121):  # three refreshes, 40 steps of 50 ms each
        at = 10.0 + 0.05 * k
        state.iterations = 40.0 * (k // 40)
        _trtllm(table, learner, state, at)
        if k > 40:
            assert table.iteration_s[1] == pytest.approx(0.05), k
    # the next refresh is 1 s overdue: a step that long is running, or the engine stalled
    for k in range(121, 181):
        _trtllm(table, learner, state, 10.0 + 0.05 * k)
    assert table.iteration_s[1] == pytest.approx(1.0)
    state.iterations += 60.0  # the refresh comes: 60 steps in 3 s
    _trtllm(table, learner, state, 10.0 + 0.05 * 181)
    assert 0.05 < table.iteration_s[1] < 0.1


def test_an_idle_engine_has_no_step_in_progress_and_a_restart_no_negative_one() -> None:
    table, learner, state = PodTable(2), SpeedLearner(), PodState(running=2.0)
    for i, at in enumerate((1.0, 1.1, 1.2)):
        state.iterations = 500 + 2 * i
        _trtllm(table, learner, state, at)
    assert table.iteration_s[1] == pytest.approx(0.05)
    state.running = 0.0
    _trtllm(table, learner, state, 1.3)
    assert table.iteration_s[1] == 0.0
    # busy again after a restart: the counter starts over; two moves give the step again
    state.running, state.iterations = 1.0, 3.0
    _trtllm(table, learner, state, 1.4)
    assert table.iteration_s[1] == 0.0
    state.iterations = 6.0
    _trtllm(table, learner, state, 1.7)
    assert table.iteration_s[1] == pytest.approx(0.1)


def test_a_page_without_an_iteration_counter_leaves_the_step_length_unknown() -> None:
    table, learner, state = PodTable(2), SpeedLearner(), PodState(running=5.0)
    for i in range(3):
        state.finish(2, 400, prefill_s=0.05, queue_s=0.0, itl_s=0.02, output_tokens=20)
        learner.update(table, 1, _snap(state), 1.0 + 0.1 * i)
    assert table.iteration_s[1] == 0.0 and table.decode_step_s[1] > 0
