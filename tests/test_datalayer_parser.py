"""The targeted metrics parser: per-engine names, info gauges, edge cases, garbage."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.datalayer.engines import PROFILES, SGLANG, TRTLLM, VLLM, Signal, profile_for
from picker.datalayer.parser import (
    MetricsParseError,
    MetricsParser,
    parse_labels,
    parse_metrics,
)
from simulator.standin_pages import LoraSeries, PodState, render, render_vllm


def busy_state() -> PodState:
    state = PodState(waiting=7, running=12, kv_usage=0.625, block_size=32, num_gpu_blocks=4096,
                     lora=[LoraSeries(("sql",), ("chat",), 1.70e9)])
    state.finish(20, prompt_tokens=800, prefill_s=0.08, queue_s=0.02, itl_s=0.025,
                 output_tokens=51)
    return state


def _minimal(lines: str) -> str:
    """The three required vLLM gauges plus `lines`."""
    return ("vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n"
            "vllm:kv_cache_usage_perc 0.5\n" + lines)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_each_engine_page_yields_its_gauges(engine: str) -> None:
    snap = parse_metrics(render(engine, busy_state()), profile_for(engine))
    assert snap.get(Signal.WAITING) == 7
    assert snap.get(Signal.RUNNING) == 12
    assert snap.get(Signal.KV_USAGE) == 0.625
    assert snap.get(Signal.KV_BLOCK_SIZE) == 32
    assert snap.get(Signal.KV_NUM_BLOCKS) == 4096


def test_triton_trtllm_page_has_no_speed_series() -> None:
    """Triton's TensorRT-LLM backend exports gauges only: nothing for the speed learner
    (its iteration counter only says that the engine stepped, PoolState.slot_limits)."""
    snap = parse_metrics(render("trtllm", busy_state()), TRTLLM)
    assert set(snap.values) == {Signal.WAITING, Signal.RUNNING, Signal.KV_USAGE,
                                Signal.KV_BLOCK_SIZE, Signal.KV_NUM_BLOCKS, Signal.ITERATIONS}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_each_engine_page_yields_its_speed_series(engine: str) -> None:
    state = busy_state()
    snap = parse_metrics(render(engine, state), profile_for(engine))
    assert snap.get(Signal.TTFT_COUNT) == 20
    assert snap.get(Signal.TTFT_SUM) == pytest.approx(20 * 0.1)
    assert snap.get(Signal.TPOT_SUM) == pytest.approx(20 * 50 * 0.025)
    assert snap.get(Signal.TPOT_COUNT) == 20 * 50
    # SGLang counts prompt tokens as requests finish: no prefill clock
    tokens = Signal.FINISHED_PROMPT_TOKENS if engine == "sglang" else Signal.PROMPT_TOKENS
    assert snap.get(tokens) == 16000
    assert snap.get(Signal.QUEUE_TIME_SUM) == pytest.approx(20 * 0.02)


def test_vllm_specific_series() -> None:
    snap = parse_metrics(render_vllm(busy_state()), VLLM)
    assert snap.get(Signal.PREFILL_TIME_SUM) == pytest.approx(1.6)
    assert snap.get(Signal.PREFILL_TIME_COUNT) == 20
    assert snap.get(Signal.FINISHED_PROMPT_TOKENS) == 16000
    assert snap.get(Signal.GENERATION_TOKENS) == 20 * 51
    assert snap.lora is not None
    assert snap.lora.running == ("sql",)
    assert snap.lora.waiting == ("chat",)
    assert snap.lora.max_lora == 4


def test_sglang_and_trtllm_have_no_lora() -> None:
    assert parse_metrics(render("sglang", busy_state()), SGLANG).lora is None
    assert parse_metrics(render("trtllm", busy_state()), TRTLLM).lora is None


def test_vllm_old_names_fall_back() -> None:
    state = busy_state()
    snap = parse_metrics(render_vllm(state, old_names=True), VLLM)
    assert snap.get(Signal.KV_USAGE) == 0.625  # from vllm:gpu_cache_usage_perc
    assert snap.get(Signal.TPOT_COUNT) == 1000  # from vllm:time_per_output_token_seconds


def test_new_kv_name_wins_over_old_whatever_the_order() -> None:
    text = ("vllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_waiting 1\n"
            "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.25\n")
    assert parse_metrics(text, VLLM).get(Signal.KV_USAGE) == 0.25


def test_agrees_with_prometheus_client_on_every_wanted_series() -> None:
    """Cross-check against the reference parser on full realistic pages."""
    for engine, profile in PROFILES.items():
        text = render(engine, busy_state())
        reference: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = profile.key_of(sample.name, sample.labels)
                if key is not None:
                    reference[key] = reference.get(key, 0.0) + sample.value
        assert len(reference) >= 5, engine  # the cross-check is never vacuous
        snap = parse_metrics(text, profile)
        for name, value in reference.items():
            signal = profile.names[name]
            if signal in (Signal.LORA_INFO, Signal.CACHE_INFO) or profile.rank[name] > 0:
                continue
            assert snap.get(signal) == pytest.approx(value), (engine, name)


def test_lora_newest_series_wins() -> None:
    text = _minimal(
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 1.7000000002e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",'
        'waiting_lora_adapters=""} 1.7000000009e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
        'waiting_lora_adapters="old"} 1.7000000001e+09\n')
    lora = parse_metrics(text, VLLM).lora
    assert lora is not None
    assert lora.running == ("new",)
    assert lora.waiting == ()
    assert lora.max_lora == 2


def test_lora_adapters_are_split_and_trimmed() -> None:
    text = _minimal('vllm:lora_requests_info{running_lora_adapters="a, b,,c",'
                    'waiting_lora_adapters="d",max_lora="8"} 5\n')
    lora = parse_metrics(text, VLLM).lora
    assert lora is not None
    assert lora.running == ("a", "b", "c")
    assert lora.waiting == ("d",)
    assert lora.max_lora == 8


def test_escaped_label_values() -> None:
    labels = parse_labels(r'a="x\"y",b="back\\slash",c="new\nline",d="brace}",e="comma,"')
    assert labels == {"a": 'x"y', "b": "back\\slash", "c": "new\nline", "d": "brace}",
                      "e": "comma,"}


def test_escaped_quotes_and_braces_in_labels_of_wanted_series() -> None:
    text = ('vllm:num_requests_waiting{model_name="we\\"ird} name",engine="0"} 4\n'
            'vllm:num_requests_running{model_name="x"} 1\n'
            'vllm:kv_cache_usage_perc{model_name="{}"} 0.1\n'
            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="q\\"a",'
            'waiting_lora_adapters=""} 9\n')
    snap = parse_metrics(text, VLLM)
    assert snap.get(Signal.WAITING) == 4
    assert snap.lora is not None and snap.lora.running == ('q"a',)


def test_several_series_of_one_name_are_summed_and_kv_takes_the_max() -> None:
    text = ('vllm:num_requests_waiting{engine="0"} 3\nvllm:num_requests_waiting{engine="1"} 4\n'
            'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 1\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n')
    snap = parse_metrics(text, VLLM)
    assert snap.get(Signal.WAITING) == 7
    assert snap.get(Signal.RUNNING) == 2
    assert snap.get(Signal.KV_USAGE) == 0.7


def test_any_model_name_is_accepted() -> None:
    text = _minimal('vllm:prompt_tokens_total{model_name="something-else"} 10\n')
    assert parse_metrics(text, VLLM).get(Signal.PROMPT_TOKENS) == 10


def test_special_values_and_timestamps() -> None:
    text = ("vllm:num_requests_waiting 1 1700000000000\nvllm:num_requests_running +Inf\n"
            "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc NaN\n"
            "vllm:gpu_cache_usage_perc 0.3\nvllm:prompt_tokens_total 1e3\n")
    snap = parse_metrics(text, VLLM)
    assert snap.get(Signal.WAITING) == 1
    assert snap.get(Signal.RUNNING) == 2  # +Inf is dropped, not summed
    assert snap.get(Signal.KV_USAGE) == 0.3  # NaN dropped: the older name fills in
    assert snap.get(Signal.PROMPT_TOKENS) == 1000


def test_comments_and_prefixed_names_are_not_samples() -> None:
    text = ("# HELP vllm:num_requests_waiting 99\n# TYPE vllm:num_requests_waiting gauge\n"
            "vllm:num_requests_waiting_extra 50\nvllm:num_requests_waiting 1\n"
            "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.5\n"
            "vllm:prompt_tokens_created 1.7e9\n")
    snap = parse_metrics(text, VLLM)
    assert snap.get(Signal.WAITING) == 1
    assert Signal.PROMPT_TOKENS not in snap.values


def test_first_line_crlf_and_missing_final_newline() -> None:
    text = ("vllm:num_requests_waiting 5\r\nvllm:num_requests_running 2\r\n"
            "vllm:kv_cache_usage_perc 0.5")
    snap = parse_metrics(text, VLLM)
    assert (snap.get(Signal.WAITING), snap.get(Signal.KV_USAGE)) == (5, 0.5)


def test_histogram_buckets_are_ignored() -> None:
    text = _minimal('vllm:time_to_first_token_seconds_bucket{le="+Inf"} 7\n'
                    'vllm:time_to_first_token_seconds_count 7\n'
                    'vllm:time_to_first_token_seconds_sum 0.7\n')
    snap = parse_metrics(text, VLLM)
    assert (snap.get(Signal.TTFT_COUNT), snap.get(Signal.TTFT_SUM)) == (7, 0.7)


@pytest.mark.parametrize("text", [
    "",
    "<html><body>502 Bad Gateway</body></html>\n",
    "vllm:num_requests_waiting 1\n",  # required series missing
    "vllm:num_requests_waiting{engine=\"0\" 1\n" + _minimal(""),  # unterminated labels
    _minimal("vllm:prompt_tokens_total abc\n"),  # non-numeric value
    _minimal("vllm:prompt_tokens_total 1 2 3\n"),  # too many fields
    _minimal("vllm:prompt_tokens_total\n"),  # no value
    _minimal('vllm:lora_requests_info{max_lora=2} 1\n'),  # unquoted label value
    _minimal('vllm:lora_requests_info{max_lora="2"running_lora_adapters=""} 1\n'),
    "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0\n",
    "\x00\x01\x02 binary junk \xff",
])
def test_garbage_raises_a_typed_error(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(text, VLLM)


def test_truncated_page_is_an_error_not_a_partial_read() -> None:
    page = render_vllm(busy_state())
    cut = page[: page.index("vllm:num_requests_waiting") + len("vllm:num_requests_wai")]
    with pytest.raises(MetricsParseError):
        parse_metrics(cut, VLLM)


def test_garbage_in_unwanted_series_is_ignored() -> None:
    text = _minimal("some_other_metric{broken 1 2 3 4\n")
    assert parse_metrics(text, VLLM).get(Signal.WAITING) == 1


def test_cache_info_labels_per_engine() -> None:
    sglang = ("sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\nsglang:token_usage 0\n"
              'sglang:cache_config_info{page_size="64",num_pages="100"} 1\n')
    snap = parse_metrics(sglang, SGLANG)
    assert (snap.get(Signal.KV_BLOCK_SIZE), snap.get(Signal.KV_NUM_BLOCKS)) == (64, 100)
    vllm = _minimal('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n')
    snap = parse_metrics(vllm, VLLM)
    assert snap.get(Signal.KV_BLOCK_SIZE) == 16
    assert math.isnan(snap.get(Signal.KV_NUM_BLOCKS))


def test_parser_is_reusable_and_stateless() -> None:
    parser = MetricsParser(VLLM)
    first = parser.parse(_minimal(""))
    second = parser.parse(_minimal("vllm:prompt_tokens_total 5\n"))
    assert Signal.PROMPT_TOKENS not in first.values
    assert second.get(Signal.PROMPT_TOKENS) == 5


def test_unknown_engine_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown engineType"):
        profile_for("tgi")
