"""The /metrics page of a simulated pod, written from its engine's numbers (exposition.py).

A fleet of many pods is scraped every 50 ms by the gateway; building the text directly from
the engine's numbers costs a few tens of microseconds, where a prometheus_client registry per
pod would cost far more. Names, label sets and bucket bounds follow what vLLM (v1 engine) and
SGLang export.
"""

from __future__ import annotations

import time

from simulator.engine import Engine
from simulator.exposition import Page, escape
from simulator.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GARBLED = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="\n'
    b"}}} not a sample 1.0.0\nvllm:kv_cache_usage_perc{ NaNNaN\n"
)


class _Text(Page):
    """One scrape's page, every series carrying the pod's own labels after any others.

    Labels are written as f-strings rather than through `label_text`: this runs on every
    scrape of every pod, and only the model name and adapter names need escaping.
    """

    def __init__(self, labels: str) -> None:
        super().__init__()
        self.labels = labels  # e.g. 'engine="0",model_name="m"'

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.metric(name, "gauge", help_text, self.labels, value)

    def counter(self, name: str, help_text: str, value: float) -> None:
        self.metric(name, "counter", help_text, self.labels, value)

    def counter_by(self, name: str, help_text: str, label: str, values: dict[str, int]) -> None:
        self.head(name, "counter", help_text)
        for key, value in values.items():
            self.sample(name, f'{label}="{escape(key)}",{self.labels}', value)

    def info(self, name: str, help_text: str, labels: str) -> None:
        """A gauge of 1.0 whose labels carry the information, before the pod's own."""
        self.metric(name, "gauge", help_text, f"{labels},{self.labels}", 1.0)

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        key = (self.labels, hist.count)
        cached = hist.rendered.get(name)
        if cached is None or cached[0] != key:
            part = Page()
            part.head(name, "histogram", help_text)
            part.histogram_series(name, self.labels, hist.bounds, hist.cumulative(), hist.sum,
                                  le_first=True)
            cached = hist.rendered[name] = (key, "\n".join(part.lines))
        self.lines.append(cached[1])


def render(engine: Engine, kind: str) -> bytes:
    """The /metrics body of a pod running engine ``kind`` ("vllm" or "sglang")."""
    return render_sglang(engine) if kind == "sglang" else render_vllm(engine)


def render_vllm(engine: Engine) -> bytes:
    stats, kv = engine.stats, engine.kv
    out = _Text(f'engine="0",model_name="{escape(engine.config.model)}"')
    out.gauge("vllm:num_requests_running",
              "Number of requests in model execution batches.", len(engine.running))
    out.gauge("vllm:num_requests_waiting",
              "Number of requests waiting to be processed.", len(engine.waiting))
    out.gauge("vllm:kv_cache_usage_perc",
              "KV-cache usage. 1 means 100 percent usage.", kv.usage)
    out.gauge("vllm:gpu_cache_usage_perc",
              "GPU KV-cache usage. 1 means 100 percent usage.", kv.usage)
    out.counter("vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_queries)
    out.counter("vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits)
    out.counter("vllm:num_preemptions_total",
                "Cumulative number of preemption from the engine.", stats.preemptions)
    out.counter("vllm:prompt_tokens_total",
                "Number of prefill tokens processed.", stats.prompt_tokens)
    out.counter("vllm:generation_tokens_total",
                "Number of generation tokens processed.", stats.generation_tokens)
    out.counter_by("vllm:request_success_total", "Count of successfully processed requests.",
                   "finished_reason", stats.success)
    _lora_info(out, engine)
    _cache_config(out, engine)
    out.histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", stats.ttft)
    out.histogram("vllm:request_queue_time_seconds",
                  "Histogram of time spent in WAITING phase for request.", stats.queue_time)
    out.histogram("vllm:request_prefill_time_seconds",
                  "Histogram of time spent in PREFILL phase for request.", stats.prefill_time)
    out.histogram("vllm:time_per_output_token_seconds",
                  "Histogram of time per output token in seconds (deprecated: same samples as"
                  " vllm:inter_token_latency_seconds).", stats.itl)
    out.histogram("vllm:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", stats.itl)
    out.histogram("vllm:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", stats.tpot)
    out.histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", stats.e2e)
    return out.text().encode()


def _lora_info(out: _Text, engine: Engine) -> None:
    """One series per adapter-set combination seen recently, valued with the last time it
    was current: a reader keeps the newest series, as with vLLM's own gauge."""
    out.head("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
    max_lora = engine.lora.max_loras
    for (running, waiting), stamp in engine.lora_info_series(time.time()):
        out.sample("vllm:lora_requests_info",
                   f'max_lora="{max_lora}",running_lora_adapters="{escape(running)}",'
                   f'waiting_lora_adapters="{escape(waiting)}"', stamp)


def _cache_config(out: _Text, engine: Engine) -> None:
    out.info("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
             f'block_size="{engine.profile.block_size}",enable_prefix_caching="True",'
             f'gpu_memory_utilization="0.9",num_gpu_blocks="{engine.kv.num_blocks}"')


def render_sglang(engine: Engine) -> bytes:
    stats, kv = engine.stats, engine.kv
    out = _Text(f'model_name="{escape(engine.config.model)}"')
    out.gauge("sglang:num_running_reqs", "The number of running requests.",
              len(engine.running))
    out.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
              len(engine.waiting))
    out.gauge("sglang:token_usage", "The token usage.", kv.usage)
    hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
    out.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
    out.gauge("sglang:gen_throughput", "The generation throughput (token/s).",
              engine.current_gen_throughput())
    out.counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                stats.prompt_tokens)
    out.counter("sglang:generation_tokens_total",
                "Number of generation tokens processed.", stats.generation_tokens)
    out.info("sglang:cache_config_info", "KV cache configuration.",
             f'page_size="{engine.profile.block_size}",num_pages="{engine.kv.num_blocks}"')
    out.histogram("sglang:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", stats.ttft)
    out.histogram("sglang:queue_time_seconds",
                  "Histogram of time spent in the waiting queue in seconds.", stats.queue_time)
    out.histogram("sglang:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", stats.itl)
    out.histogram("sglang:e2e_request_latency_seconds",
                  "Histogram of end-to-end request latency in seconds.", stats.e2e)
    return out.text().encode()
