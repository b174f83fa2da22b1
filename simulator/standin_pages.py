"""Engine `/metrics` pages rendered from numbers you control.

For the data layer's tests, its benchmark and their stand-in pods (standin.py), so
that everything that checks the parser and the collectors reads pages shaped like
the real ones: HELP/TYPE comments, `_created` series, full histogram bucket ladders,
and the Python runtime and HTTP-server series vLLM's page carries, which the gateway
must skip. The lines are written by exposition.py, the simulator's own writer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from simulator.exposition import Page, label_text
from simulator.stats import REQUEST_LATENCY_BUCKETS as LATENCY_BUCKETS
from simulator.stats import TOKEN_LATENCY_BUCKETS as TPOT_BUCKETS
from simulator.stats import TTFT_BUCKETS

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_Histogram = tuple[str, float, float, tuple[float, ...]]  # name, sum, count, buckets
HTTP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
CREATED = 1.7e9  # the `_created` timestamp of every counter and histogram


@dataclass
class LoraSeries:
    """One label combination of `vllm:lora_requests_info`; `stamp` is its value."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    stamp: float = 1.7e9


@dataclass
class PodState:
    """The numbers a stand-in pod reports; counters only ever go up (until `restart`)."""

    model_name: str = "meta-llama/Llama-3.1-8B-Instruct"
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    max_lora: int = 4
    lora: list[LoraSeries] = field(default_factory=list)
    block_size: int = 16
    num_gpu_blocks: int = 8192
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    prefill_sum: float = 0.0
    prefill_count: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished_prompt_tokens: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    iterations: float = 0.0  # engine steps run (TensorRT-LLM's iteration counter)

    def finish(self, n: int, prompt_tokens: int, prefill_s: float, queue_s: float,
               itl_s: float, output_tokens: int, cached_tokens: int = 0) -> None:
        """Account `n` finished requests of identical shape, as vLLM would; `cached_tokens`
        of each prompt were found in the prefix cache."""
        self.prefix_queries += n * prompt_tokens
        self.prefix_hits += n * cached_tokens
        self.prompt_tokens += n * prompt_tokens
        self.finished_prompt_tokens += n * prompt_tokens
        self.generation_tokens += n * output_tokens
        self.prefill_sum += n * prefill_s
        self.prefill_count += n
        self.queue_sum += n * queue_s
        self.queue_count += n
        self.ttft_sum += n * (queue_s + prefill_s)
        self.ttft_count += n
        self.itl_sum += n * (output_tokens - 1) * itl_s
        self.itl_count += n * (output_tokens - 1)

    def restart(self) -> None:
        """A pod restart: every counter and histogram starts again from zero."""
        for name in ("ttft_sum", "ttft_count", "prefill_sum", "prefill_count", "queue_sum",
                     "queue_count", "itl_sum", "itl_count", "prompt_tokens",
                     "generation_tokens", "finished_prompt_tokens", "prefix_queries",
                     "prefix_hits"):
            setattr(self, name, 0.0)


def busy_state() -> PodState:
    """A pod under steady load: the page the benchmark parses and its stand-in fleet serves."""
    state = PodState(waiting=4, running=17, kv_usage=0.42,
                     lora=[LoraSeries(("sql",), ("chat",), 1.7e9)])
    state.finish(500, 1200, prefill_s=0.09, queue_s=0.03, itl_s=0.021, output_tokens=180)
    return state


class _Page:
    """Samples by label dict, with `_created` after counters and histograms."""

    def __init__(self) -> None:
        self.page = Page()

    def head(self, name: str, kind: str, doc: str) -> None:
        self.page.head(name, kind, doc)

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.page.sample(name, label_text(labels), value)

    def gauge(self, name: str, labels: dict[str, str], value: float, doc: str = "") -> None:
        self.head(name, "gauge", doc or name)
        self.sample(name, labels, value)

    def counter(self, name: str, labels: dict[str, str], value: float, doc: str = "") -> None:
        base = name.removesuffix("_total")
        self.head(base, "counter", doc or name)
        self.sample(name, labels, value)
        self.sample(f"{base}_created", labels, CREATED)

    def histogram(self, name: str, labels: dict[str, str], total: float, count: float,
                  buckets: tuple[float, ...], doc: str = "") -> None:
        self.head(name, "histogram", doc or name)
        self.histogram_series(name, labels, total, count, buckets)

    def histogram_series(self, name: str, labels: dict[str, str], total: float, count: float,
                         buckets: tuple[float, ...]) -> None:
        """Every request at the mean: each bucket holds all of them or none."""
        mean = total / count if count else 0.0
        cumulative = [count if le >= mean else 0 for le in buckets] + [count]
        self.page.histogram_series(name, label_text(labels), buckets, cumulative, total)
        self.sample(f"{name}_created", labels, CREATED)

    def text(self) -> str:
        return self.page.text()


def _python_runtime(page: _Page) -> None:
    """The default prometheus_client collectors every Python server exports."""
    for name in ("python_gc_objects_collected_total", "python_gc_collections_total"):
        page.head(name, "counter", "Python garbage collector statistics")
        for gen in ("0", "1", "2"):
            page.sample(name, {"generation": gen}, 12345.0)
    page.gauge("python_info", {"implementation": "CPython", "major": "3", "minor": "12",
                               "patchlevel": "3", "version": "3.12.3"}, 1.0)
    for name, value in (("process_virtual_memory_bytes", 4.2e10),
                        ("process_resident_memory_bytes", 3.1e9),
                        ("process_start_time_seconds", 1.7e9),
                        ("process_open_fds", 120.0), ("process_max_fds", 1048576.0)):
        page.gauge(name, {}, value)
    page.counter("process_cpu_seconds_total", {}, 1234.5)


def _http_server(page: _Page) -> None:
    """What prometheus-fastapi-instrumentator adds to vLLM's page: per-handler series."""
    handlers = ("/v1/completions", "/v1/chat/completions", "/metrics", "/health", "/v1/models")
    page.head("http_requests_total", "counter", "Total number of requests.")
    for h in handlers:
        for status in ("2xx", "4xx"):
            labels = {"handler": h, "method": "POST", "status": status}
            page.sample("http_requests_total", labels, 99.0)
    for metric in ("http_request_size_bytes", "http_response_size_bytes"):
        page.head(metric, "summary", "Content length of requests/responses.")
        for h in handlers:
            page.sample(f"{metric}_count", {"handler": h}, 99.0)
            page.sample(f"{metric}_sum", {"handler": h}, 123456.0)
            page.sample(f"{metric}_created", {"handler": h}, CREATED)
    page.head("http_request_duration_highr_seconds", "histogram", "Latency with many buckets.")
    page.histogram_series("http_request_duration_highr_seconds", {}, 50.0, 99.0, HTTP_BUCKETS)
    page.head("http_request_duration_seconds", "histogram", "Latency with only few buckets.")
    for h in handlers:
        page.histogram_series("http_request_duration_seconds", {"handler": h, "method": "POST"},
                              50.0, 99.0, (0.1, 0.5, 1.0))


def _vllm_histograms(s: PodState, old_names: bool) -> list[_Histogram]:
    """(name, sum, count, buckets) of every histogram a vLLM V1 server exports."""
    done = s.prefill_count
    tpot = [("vllm:time_per_output_token_seconds", s.itl_sum, s.itl_count, TPOT_BUCKETS)]
    if not old_names:
        tpot.append(("vllm:inter_token_latency_seconds", s.itl_sum, s.itl_count, TPOT_BUCKETS))
    return [
        ("vllm:iteration_tokens_total", s.prompt_tokens + s.generation_tokens,
         max(done, 1.0) * 10, ITERATION_BUCKETS),
        ("vllm:request_prompt_tokens", s.finished_prompt_tokens, done, TOKEN_BUCKETS),
        ("vllm:request_generation_tokens", s.generation_tokens, done, TOKEN_BUCKETS),
        ("vllm:request_max_num_generation_tokens", s.generation_tokens, done, TOKEN_BUCKETS),
        ("vllm:request_params_n", done, done, (1, 2, 5, 10, 20)),
        ("vllm:request_params_max_tokens", done * 256, done, TOKEN_BUCKETS),
        ("vllm:time_to_first_token_seconds", s.ttft_sum, s.ttft_count, TTFT_BUCKETS),
        *tpot,
        ("vllm:request_time_per_output_token_seconds", s.itl_sum, s.itl_count, TPOT_BUCKETS),
        ("vllm:e2e_request_latency_seconds", s.ttft_sum + s.itl_sum, done, LATENCY_BUCKETS),
        ("vllm:request_queue_time_seconds", s.queue_sum, s.queue_count, LATENCY_BUCKETS),
        ("vllm:request_inference_time_seconds", s.prefill_sum + s.itl_sum, done,
         LATENCY_BUCKETS),
        ("vllm:request_prefill_time_seconds", s.prefill_sum, s.prefill_count, LATENCY_BUCKETS),
        ("vllm:request_decode_time_seconds", s.itl_sum, done, LATENCY_BUCKETS),
    ]


def _vllm_cache_info(s: PodState) -> dict[str, str]:
    return {
        "block_size": str(s.block_size), "cache_dtype": "auto", "calculate_kv_scales": "False",
        "cpu_offload_gb": "0", "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(s.num_gpu_blocks),
        "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "builtin",
        "sliding_window": "None", "swap_space": "4", "swap_space_bytes": "4294967296",
    }


def render_vllm(state: PodState, *, old_names: bool = False, extras: bool = True) -> str:
    """A vLLM V1 page; `old_names` uses the pre-0.10 KV name and the old TPOT histogram."""
    page = _Page()
    model = {"model_name": state.model_name, "engine": "0"}
    if extras:
        _python_runtime(page)
    page.gauge("vllm:num_requests_running", model, state.running)
    page.gauge("vllm:num_requests_waiting", model, state.waiting)
    kv_name = "vllm:gpu_cache_usage_perc" if old_names else "vllm:kv_cache_usage_perc"
    page.gauge(kv_name, model, state.kv_usage, "KV-cache usage. 1 means 100 percent usage.")
    for name, value in (("vllm:prefix_cache_queries_total", state.prefix_queries),
                        ("vllm:prefix_cache_hits_total", state.prefix_hits),
                        ("vllm:num_preemptions_total", 0.0),
                        ("vllm:prompt_tokens_total", state.prompt_tokens),
                        ("vllm:generation_tokens_total", state.generation_tokens)):
        page.counter(name, model, value)
    page.head("vllm:request_success", "counter", "Count of successfully processed requests.")
    for reason in ("stop", "length", "abort"):
        page.sample("vllm:request_success_total", {**model, "finished_reason": reason}, 10.0)
    if state.lora or state.max_lora:
        page.head("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
        for series in state.lora:
            page.sample("vllm:lora_requests_info", {
                "max_lora": str(state.max_lora),
                "running_lora_adapters": ",".join(series.running),
                "waiting_lora_adapters": ",".join(series.waiting)}, series.stamp)
    page.gauge("vllm:cache_config_info", _vllm_cache_info(state), 1.0)
    for name, total, count, buckets in _vllm_histograms(state, old_names):
        page.histogram(name, model, total, count, buckets)
    if extras:
        _http_server(page)
    return page.text()


def render_sglang(state: PodState) -> str:
    s, page = state, _Page()
    model = {"model_name": s.model_name}
    page.counter("sglang:prompt_tokens_total", model, s.prompt_tokens)
    page.counter("sglang:generation_tokens_total", model, s.generation_tokens)
    page.gauge("sglang:num_running_reqs", model, s.running)
    page.gauge("sglang:num_queue_reqs", model, s.waiting)
    page.gauge("sglang:token_usage", model, s.kv_usage)
    page.gauge("sglang:cache_hit_rate", model, 0.2)
    page.gauge("sglang:cache_config_info", {**model, "page_size": str(s.block_size),
                                            "num_pages": str(s.num_gpu_blocks)}, 1.0)
    for name, total, count, buckets in (
        ("sglang:time_to_first_token_seconds", s.ttft_sum, s.ttft_count, TTFT_BUCKETS),
        ("sglang:inter_token_latency_seconds", s.itl_sum, s.itl_count, TPOT_BUCKETS),
        ("sglang:e2e_request_latency_seconds", s.ttft_sum + s.itl_sum, s.prefill_count,
         LATENCY_BUCKETS),
        ("sglang:queue_time_seconds", s.queue_sum, s.queue_count, LATENCY_BUCKETS),
    ):
        page.histogram(name, model, total, count, buckets)
    return page.text()


TRITON_MAX_REQUESTS = 256  # request_type="max" (a server setting) on the fixture page


def _triton_number(value: float) -> str:
    """Triton writes whole numbers without a fraction (`256`, not `256.0`)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _triton_family(page: _Page, name: str, kind: str, doc: str, label: str,
                   rows: tuple[tuple[str, float], ...], model: str = "tensorrt_llm") -> None:
    """One `nv_trt_llm_*` family: one series per `label` value, labels in Triton's order."""
    page.head(name, kind, doc)
    for value_label, value in rows:
        labels = label_text(dict(sorted({label: value_label, "model": model,
                                         "version": "1"}.items())))
        page.page.lines.append(f"{name}{{{labels}}} {_triton_number(value)}")


def _triton_core(page: _Page, done: float) -> None:
    """Triton's own per-model counters, which a TensorRT-LLM router must skip."""
    for name, doc in (("nv_inference_request_success",
                       "Number of successful inference requests, all batch sizes"),
                      ("nv_inference_request_failure",
                       "Number of failed inference requests, all batch sizes"),
                      ("nv_inference_count",
                       "Number of inferences performed (does not include cached requests)")):
        page.head(name, "counter", doc)
        for model in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm"):
            value = 0.0 if name == "nv_inference_request_failure" else done
            labels = label_text({"model": model, "version": "1"})
            page.page.lines.append(f"{name}{{{labels}}} {_triton_number(value)}")


def render_trtllm(state: PodState) -> str:
    """Triton with the TensorRT-LLM backend, shaped like tests/fixtures/metrics/
    triton-trtllm-2025-04.txt (families, label names and order, value spelling).

    Triton exports no latency histograms or token counters for TensorRT-LLM, so
    only the series a router reads come from `state`: waiting, running
    ("scheduled"), KV use ("fraction"), block size ("tokens_per"), block count
    ("max") and the iteration counter; the other series keep the fixture's values.
    """
    s, page = state, _Page()
    used = round(s.kv_usage * s.num_gpu_blocks)
    _triton_core(page, s.prefill_count)
    _triton_family(page, "nv_trt_llm_request_metrics", "gauge", "TRT LLM request metrics",
                   "request_type", (("waiting", s.waiting), ("context", 0.0),
                                    ("scheduled", s.running), ("max", TRITON_MAX_REQUESTS),
                                    ("active", s.waiting + s.running)))
    _triton_family(page, "nv_trt_llm_runtime_memory_metrics", "gauge",
                   "TRT LLM runtime memory metrics", "memory_type",
                   (("pinned", 0.0), ("gpu", 2101248.0), ("cpu", 0.0)))
    _triton_family(page, "nv_trt_llm_kv_cache_block_metrics", "gauge",
                   "TRT LLM KV cache block metrics", "kv_cache_block_type",
                   (("fraction", s.kv_usage), ("tokens_per", s.block_size), ("used", used),
                    ("free", s.num_gpu_blocks - used), ("max", s.num_gpu_blocks)))
    _triton_family(page, "nv_trt_llm_inflight_batcher_metrics", "gauge",
                   "TRT LLM inflight_batcher-specific metrics",
                   "inflight_batcher_specific_metric",
                   (("micro_batch_id", 0.0), ("generation_requests", 0.0),
                    ("total_context_tokens", 0.0)))
    _triton_family(page, "nv_trt_llm_general_metrics", "gauge", "General TRT LLM metrics",
                   "general_type", (("iteration_counter", s.iterations), ("timestamp", CREATED)))
    _triton_family(page, "nv_trt_llm_disaggregated_serving_metrics", "counter",
                   "TRT LLM disaggregated serving metrics", "disaggregated_serving_type",
                   (("kv_cache_transfer_ms", 0.0), ("request_count", 0.0)))
    return page.text()


RENDERERS = {"vllm": render_vllm, "sglang": render_sglang, "trtllm": render_trtllm}


def render(engine: str, state: PodState) -> str:
    return RENDERERS[engine](state)
