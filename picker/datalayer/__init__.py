"""The data layer: turns pods' metrics into numbers in the datastore's columns.

Sources (a direct `/metrics` scrape, or PromQL against a Prometheus server)
and per-engine profiles (vLLM, SGLang, TensorRT-LLM) that say which series
mean what. Runs entirely off the request path; the request path reads the
columns and `fresh_mask()`.

Layering, lowest first: engines → parser → speed → columns → prometheus_source
→ collector. Nothing here imports the scheduler or the handlers.
"""

from picker.datalayer.collector import Collector, CollectorOptions, MetricsCollector, ScrapeError
from picker.datalayer.columns import WRITTEN_COLUMNS, fresh_mask, write_outcome, write_snapshot
from picker.datalayer.engines import (
    PROFILES,
    SGLANG,
    TRTLLM,
    VLLM,
    EngineProfile,
    Signal,
    profile_for,
)
from picker.datalayer.parser import (
    LoraInfo,
    MetricsParseError,
    MetricsParser,
    MetricsSnapshot,
    parse_metrics,
    parser_for,
)
from picker.datalayer.prometheus_source import PrometheusPoolSource, PrometheusSourceOptions
from picker.datalayer.speed import SpeedLearner
from picker.datalayer.stats import PodScrapeStats, ScrapeCounters

__all__ = [
    "PROFILES",
    "SGLANG",
    "TRTLLM",
    "VLLM",
    "WRITTEN_COLUMNS",
    "Collector",
    "CollectorOptions",
    "EngineProfile",
    "LoraInfo",
    "MetricsCollector",
    "MetricsParseError",
    "MetricsParser",
    "MetricsSnapshot",
    "PodScrapeStats",
    "PrometheusPoolSource",
    "PrometheusSourceOptions",
    "ScrapeCounters",
    "ScrapeError",
    "Signal",
    "SpeedLearner",
    "fresh_mask",
    "parse_metrics",
    "parser_for",
    "profile_for",
    "write_outcome",
    "write_snapshot",
]
