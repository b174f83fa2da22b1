"""Prometheus exposition text of a pod's /metrics, written by hand.

A fleet of many pods is scraped every 50 ms by the gateway; building the text directly from
the engine's numbers costs a few tens of microseconds, where a prometheus_client registry per
pod would cost far more. Names, label sets and bucket bounds follow what vLLM (v1 engine) and
SGLang export.
"""

from __future__ import annotations

import time

from simulator.engine import Engine
from simulator.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GARBLED = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="\n'
    b"}}} not a sample 1.0.0\nvllm:kv_cache_usage_perc{ NaNNaN\n"
)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    """Accumulates exposition lines for one scrape."""

    def __init__(self, labels: str) -> None:
        self.labels = labels  # e.g. 'engine="0",model_name="m"'
        self.lines: list[str] = []

    def sample(self, name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.append(f"{name}{{{extra}{self.labels}}} {float(value)!r}")

    def counter_by(self, name: str, help_text: str, label: str, values: dict[str, int]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} counter")
        for key, value in values.items():
            self.lines.append(f'{name}{{{label}="{escape(key)}",{self.labels}}} {float(value)!r}')

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        key = (self.labels, hist.count)
        cached = hist.rendered.get(name)
        if cached is None or cached[0] != key:
            cached = hist.rendered[name] = (key, self._histogram_text(name, help_text, hist))
        self.lines.append(cached[1])

    def _histogram_text(self, name: str, help_text: str, hist: Histogram) -> str:
        labels = self.labels
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = hist.cumulative()
        for bound, count in zip(hist.bounds, cumulative, strict=False):
            lines.append(f'{name}_bucket{{le="{bound!r}",{labels}}} {float(count)!r}')
        lines.append(f'{name}_bucket{{le="+Inf",{labels}}} {float(cumulative[-1])!r}')
        lines.append(f"{name}_count{{{labels}}} {float(hist.count)!r}")
        lines.append(f"{name}_sum{{{labels}}} {float(hist.sum)!r}")
        return "\n".join(lines)

    def encode(self) -> bytes:
        self.lines.append("")
        return "\n".join(self.lines).encode()


def render(engine: Engine, kind: str) -> bytes:
    """The /metrics body of a pod running engine ``kind`` ("vllm" or "sglang")."""
    return render_sglang(engine) if kind == "sglang" else render_vllm(engine)


def render_vllm(engine: Engine) -> bytes:
    stats, kv = engine.stats, engine.kv
    out = _Text(f'engine="0",model_name="{escape(engine.config.model)}"')
    out.sample("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", len(engine.running))
    out.sample("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", len(engine.waiting))
    out.sample("vllm:kv_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage.", kv.usage)
    out.sample("vllm:gpu_cache_usage_perc", "gauge",
               "GPU KV-cache usage. 1 means 100 percent usage.", kv.usage)
    out.sample("vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               stats.prefix_queries)
    out.sample("vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_hits)
    out.sample("vllm:num_preemptions_total", "counter",
               "Cumulative number of preemption from the engine.", stats.preemptions)
    out.sample("vllm:prompt_tokens_total", "counter",
               "Number of prefill tokens processed.", stats.prompt_tokens)
    out.sample("vllm:generation_tokens_total", "counter",
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
    return out.encode()


def _lora_info(out: _Text, engine: Engine) -> None:
    """One series per adapter-set combination seen recently, valued with the last time it
    was current: a reader keeps the newest series, as with vLLM's own gauge."""
    out.lines.append("# HELP vllm:lora_requests_info Running stats on lora requests.")
    out.lines.append("# TYPE vllm:lora_requests_info gauge")
    max_lora = engine.lora.max_loras
    for (running, waiting), stamp in engine.lora_info_series(time.time()):
        out.lines.append(
            f'vllm:lora_requests_info{{max_lora="{max_lora}",'
            f'running_lora_adapters="{escape(running)}",'
            f'waiting_lora_adapters="{escape(waiting)}"}} {stamp!r}'
        )


def _cache_config(out: _Text, engine: Engine) -> None:
    out.lines.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
    out.lines.append("# TYPE vllm:cache_config_info gauge")
    out.lines.append(
        f'vllm:cache_config_info{{block_size="{engine.profile.block_size}",'
        f'enable_prefix_caching="True",gpu_memory_utilization="0.9",'
        f'num_gpu_blocks="{engine.kv.num_blocks}",{out.labels}}} 1.0'
    )


def render_sglang(engine: Engine) -> bytes:
    stats, kv = engine.stats, engine.kv
    out = _Text(f'model_name="{escape(engine.config.model)}"')
    out.sample("sglang:num_running_reqs", "gauge", "The number of running requests.",
               len(engine.running))
    out.sample("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
               len(engine.waiting))
    out.sample("sglang:token_usage", "gauge", "The token usage.", kv.usage)
    hit_rate = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
    out.sample("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.", hit_rate)
    out.sample("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
               engine.current_gen_throughput())
    out.sample("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               stats.prompt_tokens)
    out.sample("sglang:generation_tokens_total", "counter",
               "Number of generation tokens processed.", stats.generation_tokens)
    out.lines.append("# HELP sglang:cache_config_info KV cache configuration.")
    out.lines.append("# TYPE sglang:cache_config_info gauge")
    out.lines.append(f'sglang:cache_config_info{{page_size="{engine.profile.block_size}",'
                     f'num_pages="{engine.kv.num_blocks}",{out.labels}}} 1.0')
    out.histogram("sglang:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", stats.ttft)
    out.histogram("sglang:queue_time_seconds",
                  "Histogram of time spent in the waiting queue in seconds.", stats.queue_time)
    out.histogram("sglang:inter_token_latency_seconds",
                  "Histogram of inter-token latency in seconds.", stats.itl)
    out.histogram("sglang:e2e_request_latency_seconds",
                  "Histogram of end-to-end request latency in seconds.", stats.e2e)
    return out.encode()
