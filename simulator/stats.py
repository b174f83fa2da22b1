"""Counters and histograms an engine keeps, in the shape its /metrics exports them.

Bucket bounds are vLLM's own, so a dashboard or a picker reading percentiles from the
simulator sees the same resolution it would see on a real pod.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
LATENESS_WINDOW = 100_000


class Histogram:
    """Prometheus-style histogram; observe(value, n) records n equal samples in one step."""

    __slots__ = ("bounds", "count", "counts", "rendered", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot is +Inf
        self.sum = 0.0
        self.count = 0
        # Exposition text per metric name, with the (labels, count) it was made for: most
        # histograms change once per request, while scrapes come every 50 ms.
        self.rendered: dict[str, tuple[tuple[str, int], str]] = {}

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def as_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "sum": self.sum}


@dataclass
class EngineStats:
    """Cumulative figures since the engine started (model-time seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    # SGLang adds a request's prompt and output tokens to its counters when the request
    # finishes (python/sglang/srt/metrics/collector.py, observe_one_finished_request, 0.4
    # to today); vLLM counts prompt tokens at the end of the prefill, output tokens per step
    finished_prompt_tokens: int = 0
    finished_generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    success: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0})
    aborted: int = 0
    rejected: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    # Wall-clock ms by which a first token (or a whole non-streamed answer) reached the
    # socket after the time the model says it was ready: the simulator's own fidelity.
    lateness_ms: deque[float] = field(default_factory=lambda: deque(maxlen=LATENESS_WINDOW))

    def lateness_summary(self) -> dict[str, float | int]:
        values = sorted(self.lateness_ms)
        if not values:
            return {"count": 0}

        def pct(q: float) -> float:
            return round(values[min(len(values) - 1, int(q * len(values)))], 3)

        return {"count": len(values), "p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0),
                "min": round(values[0], 3)}
