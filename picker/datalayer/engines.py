"""Per-engine metric names: which Prometheus series mean what.

Each model server spells the same few facts differently (DESIGN §4). A profile
maps every series name the gateway reads to the signal it carries, so the
parser, the direct collector and the Prometheus source all speak in signals
and never in engine-specific names. Names listed earlier for the same signal
win over later ones: that is how vLLM's current `vllm:kv_cache_usage_perc`
takes precedence over the older `vllm:gpu_cache_usage_perc` when a server
exports both.

A series may also be named with one label matcher, `name{label="value"}`:
Triton's TensorRT-LLM backend puts several facts in one family and tells them
apart by a label (`nv_trt_llm_request_metrics{request_type="waiting"}`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum


class Signal(StrEnum):
    """What a series means to the gateway, independent of engine."""

    WAITING = "waiting"
    RUNNING = "running"
    KV_USAGE = "kv_usage"
    LORA_INFO = "lora_info"
    CACHE_INFO = "cache_info"
    KV_BLOCK_SIZE = "kv_block_size"
    KV_NUM_BLOCKS = "kv_num_blocks"
    TTFT_SUM = "ttft_sum"
    TTFT_COUNT = "ttft_count"
    PREFILL_TIME_SUM = "prefill_time_sum"
    PREFILL_TIME_COUNT = "prefill_time_count"
    QUEUE_TIME_SUM = "queue_time_sum"
    QUEUE_TIME_COUNT = "queue_time_count"
    TPOT_SUM = "tpot_sum"
    TPOT_COUNT = "tpot_count"
    PROMPT_TOKENS = "prompt_tokens"
    GENERATION_TOKENS = "generation_tokens"
    ITERATIONS = "iterations"  # engine steps run (TensorRT-LLM's iteration counter)
    # prompt tokens of *finished* requests (histogram sum): observed at the same
    # moment as the prefill-time histogram, so the two deltas cover the same requests
    FINISHED_PROMPT_TOKENS = "finished_prompt_tokens"
    # requests finished (an end-to-end latency histogram's count): with the finished-prompt
    # tokens counted at the same moment, the mean prompt of finished requests
    FINISHED_REQUESTS = "finished_requests"
    # prompt tokens the engine looked up in its prefix cache, and those it found there:
    # the share of a pod's prompt tokens that cost no prefill (picker.datalayer.speed)
    PREFIX_QUERIES = "prefix_queries"
    PREFIX_HITS = "prefix_hits"


class Aggregate(StrEnum):
    """How several series of one signal (per engine rank, per model) combine."""

    SUM = "sum"
    MAX = "max"
    NEWEST = "newest"  # info gauge whose value is a timestamp: keep the newest
    FIRST = "first"


# KV usage is a fraction per engine rank: the fullest rank is what admission hits first.
_AGGREGATE = {Signal.KV_USAGE: Aggregate.MAX, Signal.LORA_INFO: Aggregate.NEWEST,
              Signal.CACHE_INFO: Aggregate.FIRST, Signal.KV_BLOCK_SIZE: Aggregate.MAX,
              Signal.KV_NUM_BLOCKS: Aggregate.SUM}

INFO_SIGNALS = frozenset({Signal.LORA_INFO, Signal.CACHE_INFO})
REQUIRED_SIGNALS = frozenset({Signal.WAITING, Signal.RUNNING, Signal.KV_USAGE})
# What a prefill speed is learned from (picker.datalayer.speed): an engine whose page has
# none of them (Triton's TensorRT-LLM backend) leaves the speed to the gateway's guesses.
PREFILL_SIGNALS = frozenset({Signal.TTFT_SUM, Signal.PREFILL_TIME_SUM, Signal.PROMPT_TOKENS,
                             Signal.FINISHED_PROMPT_TOKENS})


def aggregate_of(signal: Signal) -> Aggregate:
    return _AGGREGATE.get(signal, Aggregate.SUM)


@dataclass(frozen=True)
class EngineProfile:
    """The series one engine exports, in preference order per signal.

    `series` is (series key, signal) pairs, a key being a metric name or a name
    with one label matcher (`name{label="value"}`); `cache_labels` names the
    labels of the cache-info gauge that hold (block size, number of blocks);
    `required` are the signals without which a scrape counts as failed (a page
    that lacks the queue length is an error page, not an idle server).
    `selected` maps each matcher family's name to its label and the key of
    every wanted label value, so a reader that meets the family finds the key
    in one lookup; plain-name profiles leave it empty and pay nothing for it.
    """

    name: str
    series: tuple[tuple[str, Signal], ...]
    cache_labels: tuple[str, str] = ("block_size", "num_gpu_blocks")
    required: frozenset[Signal] = REQUIRED_SIGNALS
    # Decode steps between two settings of the load gauges while the engine decodes (0:
    # live, read at scrape time): how stale a page's queue and running may be.
    gauge_steps: int = 0
    names: dict[str, Signal] = field(init=False, repr=False, compare=False)
    rank: dict[str, int] = field(init=False, repr=False, compare=False)
    selected: dict[str, tuple[str, dict[str, str]]] = field(init=False, repr=False,
                                                           compare=False)

    def __post_init__(self) -> None:
        names = {key: signal for key, signal in self.series}
        rank: dict[str, int] = {}
        seen: dict[Signal, int] = {}
        selected: dict[str, tuple[str, dict[str, str]]] = {}
        for key, signal in self.series:
            rank[key] = seen.get(signal, 0)
            seen[signal] = rank[key] + 1
            family, label, value = split_key(key)
            if label is not None:
                held_label, keys = selected.setdefault(family, (label, {}))
                if held_label != label:
                    raise ValueError(f"{self.name}: {family} is selected by one label only")
                keys[value] = key
        if selected.keys() & names.keys():
            raise ValueError(f"{self.name}: a family is both plain and label-selected")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "selected", selected)

    def families(self) -> tuple[str, ...]:
        """The metric names a page must be searched for: plain keys and matcher families."""
        return tuple(dict.fromkeys(split_key(key)[0] for key, _ in self.series))

    def key_of(self, name: str, labels: dict[str, str]) -> str | None:
        """The series key a sample of `name` with `labels` belongs to, if wanted."""
        if name in self.names:
            return name
        chosen = self.selected.get(name)
        if chosen is None:
            return None
        return chosen[1].get(labels.get(chosen[0], ""))

    def metric_names(self, signal: Signal) -> tuple[str, ...]:
        """All names carrying `signal`, preferred first."""
        return tuple(name for name, s in self.series if s is signal)

    def signals(self) -> tuple[Signal, ...]:
        return tuple(dict.fromkeys(s for _, s in self.series))

    @property
    def measures_prefill(self) -> bool:
        """Whether the page has series a prefill speed is learned from (`PREFILL_SIGNALS`).
        A property of the engine, not of one page: SGLang creates its labelled histograms at
        a request's first observation, so a cold pod's page has none yet."""
        return not PREFILL_SIGNALS.isdisjoint(self.names.values())


_KEY_RE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"\})?')


def split_key(key: str) -> tuple[str, str | None, str]:
    """`name{label="value"}` as (name, label, value); a plain name as (name, None, "")."""
    match = _KEY_RE.fullmatch(key)
    if match is None:
        raise ValueError(f"bad series key {key!r}: want name or name{{label=\"value\"}}")
    return match.group(1), match.group(2), match.group(3) or ""


def _histogram(base: str, total: Signal, count: Signal) -> tuple[tuple[str, Signal], ...]:
    """Only _sum and _count of a histogram are read; buckets are never needed."""
    return ((f"{base}_sum", total), (f"{base}_count", count))


VLLM = EngineProfile(
    name="vllm",
    series=(
        ("vllm:num_requests_waiting", Signal.WAITING),
        ("vllm:num_requests_running", Signal.RUNNING),
        ("vllm:kv_cache_usage_perc", Signal.KV_USAGE),
        # the only KV gauge of V0 0.7 and V1 0.8 pages; 0.10.0 has kv_cache_usage_perc
        # (tests/fixtures/metrics/vllm-0.7-v0-aibrix-docs.txt, vllm-0.8-v1-..., vllm-0.10.0-v1-...)
        ("vllm:gpu_cache_usage_perc", Signal.KV_USAGE),
        ("vllm:lora_requests_info", Signal.LORA_INFO),
        ("vllm:cache_config_info", Signal.CACHE_INFO),
        *_histogram("vllm:time_to_first_token_seconds", Signal.TTFT_SUM, Signal.TTFT_COUNT),
        *_histogram("vllm:request_prefill_time_seconds",
                    Signal.PREFILL_TIME_SUM, Signal.PREFILL_TIME_COUNT),
        *_histogram("vllm:request_queue_time_seconds",
                    Signal.QUEUE_TIME_SUM, Signal.QUEUE_TIME_COUNT),
        # renamed in vLLM 0.11; both are the time between two output tokens
        *_histogram("vllm:inter_token_latency_seconds", Signal.TPOT_SUM, Signal.TPOT_COUNT),
        *_histogram("vllm:time_per_output_token_seconds", Signal.TPOT_SUM, Signal.TPOT_COUNT),
        ("vllm:prompt_tokens_total", Signal.PROMPT_TOKENS),
        ("vllm:generation_tokens_total", Signal.GENERATION_TOKENS),
        ("vllm:request_prompt_tokens_sum", Signal.FINISHED_PROMPT_TOKENS),
        # V1's prefix-cache counters, in tokens; the gpu_-prefixed names are their deprecated
        # twins ("DEPRECATED: Use vllm:prefix_cache_hits instead"), the only ones of 0.8
        # (tests/fixtures/metrics/vllm-0.10.0-v1-production-stack-617.txt, vllm-0.8-v1-...)
        ("vllm:prefix_cache_queries_total", Signal.PREFIX_QUERIES),
        ("vllm:gpu_prefix_cache_queries_total", Signal.PREFIX_QUERIES),
        ("vllm:prefix_cache_hits_total", Signal.PREFIX_HITS),
        ("vllm:gpu_prefix_cache_hits_total", Signal.PREFIX_HITS),
    ),
)

SGLANG = EngineProfile(
    name="sglang",
    series=(
        ("sglang:num_queue_reqs", Signal.WAITING),
        ("sglang:num_running_reqs", Signal.RUNNING),
        ("sglang:token_usage", Signal.KV_USAGE),
        # named by router projects (GIE, llm-d); no real SGLang page among our fixtures has it
        ("sglang:cache_config_info", Signal.CACHE_INFO),
        *_histogram("sglang:time_to_first_token_seconds", Signal.TTFT_SUM, Signal.TTFT_COUNT),
        *_histogram("sglang:queue_time_seconds", Signal.QUEUE_TIME_SUM, Signal.QUEUE_TIME_COUNT),
        # SGLang's _sum adds whole intervals and _count adds tokens: sum/count is s/token
        *_histogram("sglang:inter_token_latency_seconds", Signal.TPOT_SUM, Signal.TPOT_COUNT),
        # the only TPOT histogram of SGLang 0.4 (tests/fixtures/metrics/sglang-0.4-docs.txt)
        *_histogram("sglang:time_per_output_token_seconds", Signal.TPOT_SUM, Signal.TPOT_COUNT),
        # both counted when a request finishes (python/sglang/srt/metrics/collector.py,
        # observe_one_finished_request): no prefill clock, unlike vLLM's prompt counter
        ("sglang:prompt_tokens_total", Signal.FINISHED_PROMPT_TOKENS),
        ("sglang:generation_tokens_total", Signal.GENERATION_TOKENS),
        # observed in the same call as the counters (tests/fixtures/metrics/sglang-0.4-docs.txt)
        ("sglang:e2e_request_latency_seconds_count", Signal.FINISHED_REQUESTS),
    ),
    cache_labels=("page_size", "num_pages"),
    # the scheduler sets num_running_reqs / num_queue_reqs / token_usage at each prefill
    # batch and every `--decode-log-interval` decode steps (ServerArgs default 40), not at
    # scrape time (python/sglang/srt/managers/scheduler.py, wheels 0.4.3-0.5.23)
    gauge_steps=40,
)

# Triton Inference Server with the TensorRT-LLM backend (tests/fixtures/metrics/
# triton-trtllm-*.txt): the Gateway API Inference Extension's model-server protocol
# reads queue = "waiting", running = "scheduled", KV use = "fraction". The backend
# exports no latency histograms and no token counters, so the speed learner has
# nothing to learn from; "waiting" and "fraction" exist since the 2025-04 backend.
TRTLLM = EngineProfile(
    name="trtllm",
    series=(
        ('nv_trt_llm_request_metrics{request_type="waiting"}', Signal.WAITING),
        ('nv_trt_llm_request_metrics{request_type="scheduled"}', Signal.RUNNING),
        ('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}', Signal.KV_USAGE),
        ('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}',
         Signal.KV_BLOCK_SIZE),
        ('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}', Signal.KV_NUM_BLOCKS),
        ('nv_trt_llm_general_metrics{general_type="iteration_counter"}', Signal.ITERATIONS),
    ),
)

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (VLLM, SGLANG, TRTLLM)}


def profile_for(engine_type: str) -> EngineProfile:
    """The profile for a scheduler's `engineType`; config validation already limits the names."""
    try:
        return PROFILES[engine_type]
    except KeyError:
        raise ValueError(
            f"unknown engineType {engine_type!r}; known: {', '.join(PROFILES)}"
        ) from None
