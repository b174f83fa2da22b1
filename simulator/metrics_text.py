"""The /metrics page of a simulated pod, written from its engine's numbers (exposition.py).

A fleet of many pods is scraped every 50 ms by the gateway; building the text directly from
the engine's numbers costs a few tens of microseconds, where a prometheus_client registry per
pod would cost far more. Names, label sets, label order, HELP texts and family types follow
the real pages in tests/fixtures/metrics/ (tests/test_simulator_dialects.py compares them):
vLLM's V1 engine (`engine` and `model_name` labels, a `_created` gauge family after every
counter as prometheus_client writes it, the deprecated `gpu_prefix_cache_*` twins), SGLang
0.5 (`engine_type`, `model_name`, `pp_rank`, `tp_rank`) and Triton's TensorRT-LLM backend
(`nv_trt_llm_*` gauges keyed by `request_type` / `kv_cache_block_type`).

`PageOptions` narrows a page to one engine version's families (`VERSIONS`, each backed by a
fixture) or drops named families (`omit`), and splits a vLLM page across data-parallel ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from simulator.engine import Engine
from simulator.exposition import Page, escape, fmt_integral
from simulator.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GARBLED = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="\n'
    b"}}} not a sample 1.0.0\nvllm:kv_cache_usage_perc{ NaNNaN\n"
)
# The model label of Triton's TensorRT-LLM backend is the Triton model's name, which the
# backend's examples (and the fixtures) call "tensorrt_llm", version "1".
TRITON_MODEL_LABELS = 'model="tensorrt_llm",version="1"'

VLLM_FAMILIES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:lora_requests_info", "vllm:cache_config_info", "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
})
SGLANG_FAMILIES = frozenset({
    "sglang:num_running_reqs", "sglang:num_used_tokens", "sglang:token_usage",
    "sglang:gen_throughput", "sglang:num_queue_reqs", "sglang:cache_hit_rate",
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cache_config_info",
    "sglang:time_to_first_token_seconds", "sglang:queue_time_seconds",
    "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds",
    "sglang:e2e_request_latency_seconds",
})
TRTLLM_FAMILIES = frozenset({
    "nv_trt_llm_request_metrics", "nv_trt_llm_runtime_memory_metrics",
    "nv_trt_llm_kv_cache_block_metrics", "nv_trt_llm_inflight_batcher_metrics",
    "nv_trt_llm_general_metrics", "nv_trt_llm_disaggregated_serving_metrics",
})
FAMILIES: dict[str, frozenset[str]] = {
    "vllm": VLLM_FAMILIES, "sglang": SGLANG_FAMILIES, "trtllm": TRTLLM_FAMILIES,
}


@dataclass(frozen=True)
class Version:
    """One engine version's page where it differs from the simulator's default dialect.

    `omit` are whole families that version does not write; for Triton, `omit` may also name
    one series as `family{label="value"}`. `old_labels` writes SGLang's pre-0.5 label set
    (`model_name` only); `renames` maps a default family to the name that version used.
    """

    engine: str
    source: str  # the fixture that shows it
    omit: frozenset[str] = frozenset()
    renames: tuple[tuple[str, str], ...] = ()
    old_labels: bool = False


VERSIONS: dict[str, Version] = {
    # vLLM before the per-rank `engine` label (a 0.8 V1 page; the 0.7 V0 page has the same
    # label names): `model_name` only, so no data-parallel split
    "vllm-0.8": Version("vllm", "vllm-0.8-v1-production-stack-318.txt", old_labels=True),
    # the whole example page of SGLang's 0.4-era docs: no queue-time histogram, no
    # cache_config_info, TPOT under its old name, the model_name label only
    "sglang-0.4": Version(
        "sglang", "sglang-0.4-docs.txt",
        omit=frozenset({"sglang:queue_time_seconds", "sglang:cache_config_info"}),
        renames=(("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),),
        old_labels=True),
    # the backend before 2025-04: no waiting count, no KV fraction
    "triton-trtllm-2025-02": Version(
        "trtllm", "triton-trtllm-2025-02.txt",
        omit=frozenset({'nv_trt_llm_request_metrics{request_type="waiting"}',
                        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'})),
}


@dataclass(frozen=True)
class PageOptions:
    """What one pod's page leaves out, and over how many data-parallel ranks it is split."""

    omit: frozenset[str] = frozenset()
    data_parallel: int = 1
    version: str | None = None

    @property
    def old_labels(self) -> bool:
        return self.version is not None and VERSIONS[self.version].old_labels

    def name(self, family: str) -> str:
        """The family's name in this version (SGLang 0.4's old TPOT name)."""
        if self.version is not None:
            for default, old in VERSIONS[self.version].renames:
                if family == default:
                    return old
        return family

    @classmethod
    def build(cls, omit: Sequence[str] = (), data_parallel: int = 1,
              version: str | None = None) -> PageOptions:
        dropped = set(omit)
        if version is not None:
            dropped |= VERSIONS[version].omit
        return cls(omit=frozenset(dropped), data_parallel=data_parallel, version=version)


DEFAULT_OPTIONS = PageOptions()


class _Text(Page):
    """One scrape's page: per family one HELP/TYPE pair, then one series per rank.

    `ranks` holds each rank's own labels, sorted by name as prometheus_client writes them;
    `split` holds each rank's labels cut where `le` sorts in, for histogram buckets. Labels
    are f-strings rather than `label_text`: this runs on every scrape of every pod, and only
    the model name and adapter names need escaping.
    """

    def __init__(self, ranks: tuple[str, ...], split: tuple[tuple[str, str], ...],
                 options: PageOptions) -> None:
        super().__init__()
        self.ranks = ranks
        self.split = split
        self.omit = options.omit
        self.options = options

    def gauge(self, name: str, help_text: str, values: Sequence[float]) -> None:
        if name not in self.omit:
            self._family(name, "gauge", help_text, values)

    def counter(self, name: str, help_text: str, values: Sequence[float],
                created: float) -> None:
        """A counter and the `_created` gauge family prometheus_client writes after it."""
        if name in self.omit:
            return
        self._family(name, "counter", help_text, values)
        key = (name, self.ranks)
        cached = _CREATED.get(key)
        if cached is None or cached[0] != created:  # constant until the pod restarts
            part = _Text(self.ranks, self.split, self.options)
            part._family(name[: -len("_total")] + "_created", "gauge", help_text,
                         [created] * len(values))
            cached = _CREATED[key] = (created, "\n".join(part.lines))
        self.lines.append(cached[1])

    def _family(self, name: str, kind: str, help_text: str, values: Sequence[float]) -> None:
        if len(values) == 1:
            self.metric(name, kind, help_text, self.ranks[0], values[0])
            return
        self.head(name, kind, help_text)
        for labels, value in zip(self.ranks, values, strict=True):
            self.sample(name, labels, value)

    def counter_by(self, name: str, help_text: str, label: str, values: dict[str, int],
                   created: float) -> None:
        """A counter keyed by one more label (on rank 0), with its `_created` family."""
        if name in self.omit:
            return
        before, after = self.split[0]
        head = f"{before}," if before else ""
        for kind, family in (("counter", name), ("gauge", name[: -len("_total")] + "_created")):
            self.head(family, kind, help_text)
            for key, value in values.items():
                # `label` sorts after `engine` and before `model_name` (finished_reason)
                self.sample(family, f'{head}{label}="{escape(key)}",{after}',
                            value if kind == "counter" else created)

    def info(self, name: str, help_text: str, labels: str) -> None:
        """A gauge of 1.0 whose labels carry the information, before the pod's own."""
        if name not in self.omit:
            self.metric(name, "gauge", help_text, f"{labels},{self.ranks[0]}", 1.0)

    def histogram(self, name: str, help_text: str, hists: Sequence[Histogram]) -> None:
        if name in self.omit:
            return
        shown = self.options.name(name)
        self.head(shown, "histogram", help_text)
        for (before, after), hist in zip(self.split, hists, strict=True):
            key = (before, after, hist.count)
            cached = hist.rendered.get(shown)
            if cached is None or cached[0] != key:
                part = Page()
                part.histogram_sorted(shown, before, after, hist.bounds, hist.cumulative(),
                                      hist.sum)
                cached = hist.rendered[shown] = (key, "\n".join(part.lines))
            self.lines.append(cached[1])


def render(engine: Engine, kind: str, options: PageOptions = DEFAULT_OPTIONS,
           created: float = 0.0, now: float | None = None) -> bytes:
    """The /metrics body of a pod running engine ``kind`` ("vllm", "sglang", "trtllm");
    `created` is the Unix time the pod's engine started (vLLM's `_created` samples), `now`
    the model time of the scrape (SGLang's idle refresh of its gauges)."""
    if kind == "sglang":
        return render_sglang(engine, options, now)
    if kind == "trtllm":
        return render_trtllm(engine, options)
    return render_vllm(engine, options, created)


def split_count(total: int, ranks: int) -> list[int]:
    """`total` spread over `ranks` as evenly as integers allow, lower ranks taking the
    remainder (so the ranks' sum is the pod's figure, as the gateway sums ranks)."""
    share, extra = divmod(total, ranks)
    return [share + (1 if rank < extra else 0) for rank in range(ranks)]


_EMPTY: dict[tuple[tuple[float, ...], int], Histogram] = {}
# (counter, rank labels) -> (created time, text of its `_created` family)
_CREATED: dict[tuple[str, tuple[str, ...]], tuple[float, str]] = {}


@lru_cache(maxsize=1024)
def _vllm_labels(model: str, ranks: int,
                 old: bool) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """Each rank's label text, and the same cut where `le` sorts in (engine < le <
    model_name), built once per model and rank count; `old`: `model_name` only."""
    model = escape(model)
    if old:
        return (f'model_name="{model}"',), (("", f'model_name="{model}"'),)
    return (tuple(f'engine="{r}",model_name="{model}"' for r in range(ranks)),
            tuple((f'engine="{r}"', f'model_name="{model}"') for r in range(ranks)))


def _empty_like(hist: Histogram, rank: int) -> Histogram:
    """An empty histogram with the same bounds for a rank past 0 of a data-parallel pod;
    one per (bounds, rank), so each keeps its rendered text cached."""
    empty = _EMPTY.get((hist.bounds, rank))
    if empty is None:
        empty = _EMPTY[(hist.bounds, rank)] = Histogram(hist.bounds)
    return empty


def render_vllm(engine: Engine, options: PageOptions = DEFAULT_OPTIONS,
                created: float = 0.0) -> bytes:
    """vLLM V1's page. With `data_parallel: N` every family has one series per rank
    (`engine="0"` ... `engine="N-1"`): counts and counters are split with `split_count`,
    every rank reports the pod's KV usage (each holds its share of blocks and load), and
    `request_success_total` and the histograms are on rank 0 (empty histograms elsewhere)."""
    stats, kv = engine.stats, engine.kv
    ranks = options.data_parallel
    out = _Text(*_vllm_labels(engine.config.model, ranks, options.old_labels), options)

    def split(total: int) -> list[int]:
        return split_count(total, ranks) if ranks > 1 else [total]

    out.gauge("vllm:num_requests_running",
              "Number of requests in model execution batches.", split(len(engine.running)))
    out.gauge("vllm:num_requests_waiting",
              "Number of requests waiting to be processed.", split(len(engine.waiting)))
    usage = [kv.usage] * ranks
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    out.gauge("vllm:gpu_cache_usage_perc",
              "GPU KV-cache usage. 1 means 100 percent usage.", usage)
    queries, hits = split(stats.prefix_queries), split(stats.prefix_hits)
    out.counter("vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.", queries, created)
    out.counter("vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", hits, created)
    out.counter("vllm:gpu_prefix_cache_queries_total",
                "GPU prefix cache queries, in terms of number of queriedtokens. DEPRECATED: Use"
                " vllm:prefix_cache_queries instead.", queries, created)
    out.counter("vllm:gpu_prefix_cache_hits_total",
                "GPU prefix cache hits, in terms of number of cached tokens. DEPRECATED: Use"
                " vllm:prefix_cache_hits instead.", hits, created)
    out.counter("vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine.", split(stats.preemptions),
                created)
    out.counter("vllm:prompt_tokens_total",
                "Number of prefill tokens processed.", split(stats.prompt_tokens), created)
    out.counter("vllm:generation_tokens_total",
                "Number of generation tokens processed.", split(stats.generation_tokens),
                created)
    out.counter_by("vllm:request_success_total", "Count of successfully processed requests.",
                   "finished_reason", stats.success, created)
    _lora_info(out, engine)
    _cache_config(out, engine)
    for name, help_text, hist in (
        ("vllm:time_to_first_token_seconds",
         "Histogram of time to first token in seconds.", stats.ttft),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", stats.queue_time),
        ("vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", stats.prefill_time),
        ("vllm:time_per_output_token_seconds",
         "Histogram of time per output token in seconds (deprecated: same samples as"
         " vllm:inter_token_latency_seconds).", stats.itl),
        ("vllm:inter_token_latency_seconds",
         "Histogram of inter-token latency in seconds.", stats.itl),
        ("vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", stats.tpot),
        ("vllm:e2e_request_latency_seconds",
         "Histogram of e2e request latency in seconds.", stats.e2e),
    ):
        out.histogram(name, help_text,
                      [hist, *(_empty_like(hist, rank) for rank in range(1, ranks))])
    return out.text().encode()


def _lora_info(out: _Text, engine: Engine) -> None:
    """One series per adapter-set combination seen recently, valued with the last time it
    was current: a reader keeps the newest series, as with vLLM's own gauge. Its labels are
    the three of the real series only (no engine, no model_name)."""
    if "vllm:lora_requests_info" in out.omit:
        return
    out.head("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
    max_lora = engine.lora.max_loras
    for (running, waiting), stamp in engine.lora_info_series(time.time()):
        out.sample("vllm:lora_requests_info",
                   f'max_lora="{max_lora}",running_lora_adapters="{escape(running)}",'
                   f'waiting_lora_adapters="{escape(waiting)}"', stamp)


def _cache_config(out: _Text, engine: Engine) -> None:
    """The real gauge's label set, our values: CacheConfig's fields sorted by name, with
    each rank's `engine` among them and no `model_name` (vLLM 0.11.0,
    vllm-0.11.0-cache-config-info-issue-28924.txt); the older, shorter set without
    `engine` for the older versions (vllm-0.7-v0-aibrix-docs.txt)."""
    if "vllm:cache_config_info" in out.omit:
        return
    size, blocks = engine.profile.block_size, engine.kv.num_blocks
    help_text = "Information of the LLMEngine CacheConfig"
    if out.options.old_labels:
        out.metric("vllm:cache_config_info", "gauge", help_text,
                   f'block_size="{size}",cache_dtype="auto",'
                   'calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",'
                   'gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="0",'
                   f'num_gpu_blocks="{blocks}",num_gpu_blocks_override="None",'
                   'sliding_window="None",swap_space_bytes="0"', 1.0)
        return
    out.head("vllm:cache_config_info", "gauge", help_text)
    for rank in range(out.options.data_parallel):
        out.sample("vllm:cache_config_info",
                   f'block_size="{size}",cache_dtype="auto",calculate_kv_scales="False",'
                   'cpu_kvcache_space_bytes="None",cpu_offload_gb="0.0",'
                   f'enable_prefix_caching="True",engine="{rank}",gpu_memory_utilization="0.9",'
                   'is_attention_free="False",kv_cache_memory_bytes="None",'
                   'kv_sharing_fast_prefill="False",mamba_cache_dtype="auto",'
                   'mamba_page_size_padded="None",mamba_ssm_cache_dtype="auto",'
                   f'num_cpu_blocks="None",num_gpu_blocks="{blocks}",'
                   'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",'
                   'sliding_window="None",swap_space="0.0",swap_space_bytes="0.0"', 1.0)


def render_sglang(engine: Engine, options: PageOptions = DEFAULT_OPTIONS,
                  now: float | None = None) -> bytes:
    """SGLang 0.5's page (SGLang 0.4's with `version: sglang-0.4`), its load gauges as the
    scheduler last set them (`Engine.sglang_gauges`)."""
    stats, gauges = engine.stats, engine.sglang_gauges(now)
    model = escape(engine.config.model)
    if options.old_labels:
        labels, split = f'model_name="{model}"', ("", f'model_name="{model}"')
    else:
        labels = f'engine_type="unified",model_name="{model}",pp_rank="0",tp_rank="0"'
        split = ('engine_type="unified"', f'model_name="{model}",pp_rank="0",tp_rank="0"')
    out = _Text((labels,), (split,), options)
    out.gauge("sglang:num_running_reqs", "The number of running requests.", [gauges.running])
    out.gauge("sglang:num_used_tokens", "The number of used tokens.", [gauges.used_tokens])
    out.gauge("sglang:token_usage", "The token usage.", [gauges.usage])
    out.gauge("sglang:gen_throughput", "The generation throughput (token/s).",
              [engine.current_gen_throughput()])
    out.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
              [gauges.waiting])
    hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
    out.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", [hit_rate])
    for name, help_text, value in (
        ("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
         stats.finished_prompt_tokens),
        ("sglang:generation_tokens_total", "Number of generation tokens processed.",
         stats.finished_generation_tokens),
    ):
        if name not in out.omit:  # SGLang's exporter writes no _created families
            out.metric(name, "counter", help_text, labels, value)
    out.info("sglang:cache_config_info", "KV cache configuration.",
             f'page_size="{engine.profile.block_size}",num_pages="{engine.kv.num_blocks}"')
    out.histogram("sglang:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", [stats.ttft])
    out.histogram("sglang:queue_time_seconds",
                  "Histogram of time spent in the waiting queue in seconds.", [stats.queue_time])
    out.histogram("sglang:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", [stats.itl])
    out.histogram("sglang:e2e_request_latency_seconds",
                  "Histogram of end-to-end request latency in seconds.", [stats.e2e])
    return out.text().encode()


def render_trtllm(engine: Engine, options: PageOptions = DEFAULT_OPTIONS) -> bytes:
    """Triton's TensorRT-LLM backend page (the `nv_trt_llm_*` families of 2025-04 on).

    `scheduled` and `active` are the running requests, `context` those in their first
    iteration (one token or none yet), `max` is max_num_seqs; KV figures are in the pod's
    blocks. Values are written as prometheus-cpp writes them (integers without `.0`).
    """
    kv, running = engine.kv, engine.running
    context = sum(1 for req in running if req.generated <= 1)
    page = Page()
    omit = options.omit
    for family, kind, help_text, key, rows in (
        ("nv_trt_llm_request_metrics", "gauge", "TRT LLM request metrics", "request_type",
         (("waiting", len(engine.waiting)), ("context", context),
          ("scheduled", len(running)), ("max", engine.config.max_num_seqs),
          ("active", len(running)))),
        ("nv_trt_llm_runtime_memory_metrics", "gauge", "TRT LLM runtime memory metrics",
         "memory_type", (("pinned", 0), ("gpu", 0), ("cpu", 0))),  # not modelled
        ("nv_trt_llm_kv_cache_block_metrics", "gauge", "TRT LLM KV cache block metrics",
         "kv_cache_block_type",
         (("fraction", kv.usage), ("tokens_per", engine.profile.block_size),
          ("used", kv.used_blocks), ("free", kv.free_blocks), ("max", kv.num_blocks))),
        ("nv_trt_llm_inflight_batcher_metrics", "gauge",
         "TRT LLM inflight_batcher-specific metrics", "inflight_batcher_specific_metric",
         (("micro_batch_id", 0), ("generation_requests", len(running) - context),
          ("total_context_tokens", sum(r.prompt_tokens for r in running if r.generated <= 1)))),
        ("nv_trt_llm_general_metrics", "gauge", "General TRT LLM metrics", "general_type",
         (("iteration_counter", engine.iteration), ("timestamp", int(time.time())))),
        ("nv_trt_llm_disaggregated_serving_metrics", "counter",
         "TRT LLM disaggregated serving metrics", "disaggregated_serving_type",
         (("kv_cache_transfer_ms", 0), ("request_count", 0))),
    ):
        if family in omit:
            continue
        page.head(family, kind, help_text)
        for value_name, value in rows:
            if f'{family}{{{key}="{value_name}"}}' in omit:
                continue
            # label names sorted, as on the real page
            labels = (f'{key}="{value_name}",{TRITON_MODEL_LABELS}' if key < "model" else
                      f'model="tensorrt_llm",{key}="{value_name}",version="1"')
            page.lines.append(f"{family}{{{labels}}} {fmt_integral(value)}")
    return page.text().encode()
