"""Data-layer benchmark: parser speed and collector scrapes per CPU second.

Run: `python -m bench.bench_datalayer` (under a minute). Prints a markdown
table and writes it to bench/results/datalayer.md.

1. Parser: microseconds to read one realistic vLLM `/metrics` page (~540
   lines: histograms, Python runtime and HTTP series) with our targeted parser
   vs prometheus_client's `text_string_to_metric_families`, same page, same
   run, as a ratio (the machine is shared and noisy, DESIGN §7). The same for
   the stand-in SGLang and TensorRT-LLM pages and for every vLLM / SGLang / Triton page
   of tests/fixtures/metrics/ that carries signals (shaped after real servers'
   output; read as data files by path, not imported).
2. Collector: many stand-in pods in a separate process serve that page; the
   collector scrapes them as fast as its interval allows; we divide the
   collector process's CPU time by the good scrapes it made. Target: at least
   1,000 pod-scrapes per second per core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.procs import Child, start_piped, wait_line
from contract.config import GatewayConfig, MetricsConfig, SchedulerConfig
from picker.datalayer.collector import CollectorOptions, MetricsCollector
from picker.datalayer.engines import profile_for
from picker.datalayer.parser import MetricsParseError, MetricsParser
from picker.datastore import Datastore
from simulator.standin_pages import busy_state, render

RESULTS = Path(__file__).parent / "results" / "datalayer.md"
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "metrics"
# fixture file name prefix -> the engineType whose profile reads it (trtllm-serve has none)
FIXTURE_ENGINES = {"vllm": "vllm", "sglang": "sglang", "triton": "trtllm"}
PARSER_TARGET_RATIO = 3.0
COLLECTOR_TARGET = 1000.0
FLEET_READY_S = 30.0


def time_per_call(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds per call over 5 repeats sized to fit `budget_s`."""
    once = timeit.timeit(fn, number=1)
    number = max(1, int(budget_s / 5 / max(once, 1e-7)))
    return statistics.median(timeit.repeat(fn, number=number, repeat=5)) / number


def fixture_pages() -> dict[str, tuple[str, str]]:
    """label -> (engine, text) of the fixture pages our parser reads without error.

    Pages that are failed scrapes on purpose (HELP/TYPE only, a lone LoRA grep) are left out:
    timing an exception says nothing about the parser's normal path.
    """
    pages: dict[str, tuple[str, str]] = {}
    for path in sorted(FIXTURES.glob("*.txt")):
        engine = FIXTURE_ENGINES.get(path.name.split("-", 1)[0])
        if engine is None:
            continue
        text = path.read_text()
        try:
            MetricsParser(profile_for(engine)).parse(text)
        except MetricsParseError:
            continue
        pages[path.stem] = (engine, text)
    return pages


def bench_parser(engine: str, budget_s: float, text: str | None = None) -> dict[str, float]:
    """Our parser vs prometheus_client on one page (the stand-in busy page unless `text`)."""
    text = render(engine, busy_state()) if text is None else text
    parser = MetricsParser(profile_for(engine))

    def reference() -> None:
        for family in text_string_to_metric_families(text):
            for _ in family.samples:
                pass

    ours = time_per_call(lambda: parser.parse(text), budget_s / 2)
    theirs = time_per_call(reference, budget_s / 2)
    return {"lines": text.count("\n"), "kib": len(text) / 1024, "ours_us": ours * 1e6,
            "theirs_us": theirs * 1e6, "ratio": theirs / ours}


def start_fleet(count: int, engine: str) -> tuple[Child, list[str]]:
    """The stand-in pods in a process of their own; their addresses from its first line."""
    child = start_piped("stand-in fleet", [sys.executable, "-m", "simulator.standin", "--count",
                                           str(count), "--engine", engine], stdin_pipe=True)
    line = wait_line(child, lambda _: True, FLEET_READY_S)
    return child, json.loads(line)


async def measure_collector(addresses: list[str], interval_s: float, warmup_s: float,
                            measure_s: float) -> dict[str, float]:
    metrics = MetricsConfig(interval_s=interval_s, timeout_s=2.0, stale_after_s=5.0)
    ds = Datastore(GatewayConfig(name="bench", schedulers=(
        SchedulerConfig(name="bench", model_name="m", endpoints=tuple(addresses),
                        lora_adapters=("sql", "chat"), metrics=metrics),)))
    collector = MetricsCollector(ds, options=CollectorOptions(jitter=0.1))
    collector.start()
    try:
        await asyncio.sleep(warmup_s)
        ok0, failed0 = collector.counters.ok_total, collector.counters.failed_total
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(measure_s)
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        ok = collector.counters.ok_total - ok0
        failed = collector.counters.failed_total - failed0
    finally:
        await collector.stop()
    return {"pods": len(addresses), "scrapes": ok, "failed": failed, "wall_s": wall,
            "cpu_s": cpu, "per_s": ok / wall, "per_cpu_s": ok / cpu if cpu else 0.0,
            "cpu_us_per_scrape": cpu / ok * 1e6 if ok else 0.0}


def bench_collector(pods: int, interval_s: float, warmup_s: float,
                    measure_s: float) -> dict[str, float]:
    fleet, addresses = start_fleet(pods, "vllm")
    try:
        return asyncio.run(measure_collector(addresses, interval_s, warmup_s, measure_s))
    finally:
        fleet.stop()


def report(parsers: dict[str, dict[str, float]], collector: dict[str, float]) -> str:
    lines = [
        "# Data layer benchmark",
        "",
        f"Python {sys.version.split()[0]}, one run of `python -m bench.bench_datalayer`.",
        "",
        "## Parser: one /metrics page (median of 5 repeats)",
        "",
        "Stand-in pages (simulator/standin_pages.py) by engine, then the fixture pages of",
        "tests/fixtures/metrics/ (excerpts shaped after real servers' output, see",
        "docs/metrics-collection.md) by file name. Run on a shared 2-core machine: other",
        "sessions ran at the same time, so absolute µs are noisy; the ratios (both parsers,",
        "same page, same run) are the figures to read.",
        "",
        "| page | lines | KiB | targeted parser µs | prometheus_client µs | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for engine, r in parsers.items():
        lines.append(f"| {engine} | {r['lines']:.0f} | {r['kib']:.1f} | {r['ours_us']:.1f} | "
                     f"{r['theirs_us']:.0f} | {r['ratio']:.1f}× |")
    c = collector
    lines += [
        "",
        f"## Collector: {c['pods']:.0f} stand-in vLLM pods (separate process), "
        f"{c['wall_s']:.1f} s measured",
        "",
        "| good scrapes | failed | scrapes/s (wall) | collector CPU s | "
        "pod-scrapes per CPU-second | CPU µs per scrape |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {c['scrapes']:.0f} | {c['failed']:.0f} | {c['per_s']:.0f} | {c['cpu_s']:.2f} | "
        f"{c['per_cpu_s']:.0f} | {c['cpu_us_per_scrape']:.0f} |",
        "",
        f"Targets: parser ≥ {PARSER_TARGET_RATIO:.0f}× prometheus_client on the vLLM page; "
        f"collector ≥ {COLLECTOR_TARGET:.0f} pod-scrapes per CPU-second.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=64)
    ap.add_argument("--interval", type=float, default=0.02, help="per-pod scrape interval, s")
    ap.add_argument("--measure", type=float, default=8.0, help="collector measurement, s")
    ap.add_argument("--quick", action="store_true", help="shorter run, for smoke tests")
    ap.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = ap.parse_args(argv)
    budget = 1.0 if args.quick else 4.0
    measure = 1.5 if args.quick else args.measure
    parsers = {engine: bench_parser(engine, budget) for engine in ("vllm", "sglang", "trtllm")}
    for label, (engine, page) in fixture_pages().items():
        parsers[label] = bench_parser(engine, budget / 4, page)
    collector = bench_collector(args.pods, args.interval, 0.5 if args.quick else 2.0, measure)
    text = report(parsers, collector)
    print(text)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(text)
    ok = (parsers["vllm"]["ratio"] >= PARSER_TARGET_RATIO
          and collector["per_cpu_s"] >= COLLECTOR_TARGET)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
