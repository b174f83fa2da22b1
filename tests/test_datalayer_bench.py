"""The data-layer benchmark stays runnable (figures are not asserted: machines are noisy)."""

from __future__ import annotations

from bench.bench_datalayer import bench_parser, report


def test_parser_bench_and_report_render() -> None:
    parsers = {engine: bench_parser(engine, budget_s=0.05) for engine in ("vllm", "sglang")}
    assert parsers["vllm"]["lines"] > 400 and parsers["vllm"]["ratio"] > 0
    collector = {"pods": 2, "scrapes": 10, "failed": 0, "wall_s": 1.0, "cpu_s": 0.01,
                 "per_s": 10.0, "per_cpu_s": 1000.0, "cpu_us_per_scrape": 1000.0}
    text = report(parsers, collector)
    assert "| vllm |" in text and "pod-scrapes per CPU-second" in text
