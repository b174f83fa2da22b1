"""What `cheapest-within-slo` saves against always-fastest and a plain Envoy priority front.

    python -m bench.global_cost [--duration 30] [--levels light,medium,heavy,bursty]
    igw bench --global-cost

The demo's topology (`igw global up`, igw.global_gateway: us-east-1 H100, us-west-2
A100, eu-west-1 A10G, 0.30/0.18/0.10 per million tokens, 10/70/90 ms RTT), the same
seeded open-loop streaming chat arrivals driven through each front in turn on the same
regions, at each load level:

    cheapest-within-slo  the global router, the demo's policy (400 ms TTFT SLO)
    fastest              the global router, policy `fastest` (a second `igw global serve`)
    priority             plain Envoy, priority failover (bench.priority_front): us-east-1,
                         then us-west-2, then eu-west-1; what users build today
    priority-cheap       the same Envoy with the cheapest region first (the other order a
                         user could pick)

Per request: TTFT at the client (the first content event), within the SLO or not, the
region that served it (`x-gateway-region`, added by every front's Envoy from the
endpoint's metadata), tokens (the prompt as the simulator counts it + the usage chunk's
completion tokens) and its cost at that region's price. Between fronts the regions go
idle; before each front a few unmeasured seconds warm its connections. Results:
bench/results/global-cost.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from bench.ext_proc_servers import start_envoy
from bench.loadgen import LoadGenerator, Result
from bench.output import utc_stamp, write_results
from bench.priority_front import PRIORITY_ORDER, render_priority_bootstrap
from bench.procs import Child, start_piped, wait_line
from bench.workload import (
    Corpus,
    RequestSpec,
    chat_body,
    chat_prompt_tokens,
    lognormal,
    on_off_arrivals,
    poisson_arrivals,
)
from contract import headers as hdr
from contract.global_config import load_global_config
from igw.global_gateway import DEMO_MODELS, DEMO_REGIONS, LLAMA, regions_ready
from igw.ports import free_ports
from igw_envoy.tls import generated_files

RESULTS = Path(__file__).resolve().parent / "results"
IGW = [sys.executable, "-m", "igw.cli"]
SLO_S = 0.4  # the demo's ttftSlo for llama-3.1-8b
PRICES = {r.name: r.prices[LLAMA] for r in DEMO_REGIONS}
FRONTS = ("cheapest-within-slo", "fastest", "priority", "priority-cheap")
CHEAP_ORDER = tuple(r.name for r in sorted(DEMO_REGIONS, key=lambda r: r.prices[LLAMA]))
# Chat-like lengths (log-normal, heavy-tailed): prompts ~300 tokens median, answers ~100.
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 300, 0.7, (16, 2000)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 100, 0.6, (8, 400)
WARMUP_S = 4.0
WARMUP_RATE = 2.0
SETTLE_TIMEOUT_S = 60.0
WARM_PER_REGION = 5
WARM_OUTPUT_TOKENS = 4
TIME_CAP_S = 120.0  # per run, past the arrival window: a stuck front cannot hang the bench


@dataclass(frozen=True)
class Level:
    """One load level: Poisson at `rate`/s, or bursts of `burst_rate` for `on_s` every
    `on_s + off_s` seconds over a `rate` background."""

    name: str
    rate: float
    burst_rate: float = 0.0
    on_s: float = 0.0
    off_s: float = 0.0

    def arrivals(self, rng: random.Random, duration: float) -> list[float]:
        if self.burst_rate:
            return on_off_arrivals(rng, rate_on=self.burst_rate, rate_off=self.rate,
                                   on_s=self.on_s, off_s=self.off_s, duration=duration)
        return list(poisson_arrivals(rng, self.rate, 0.0, duration))

    def describe(self) -> str:
        if self.burst_rate:
            return (f"{self.rate:g}/s, bursts of {self.burst_rate:g}/s for {self.on_s:g} s "
                    f"every {self.on_s + self.off_s:g} s")
        return f"Poisson {self.rate:g}/s"


LEVELS = {
    level.name: level for level in (
        Level("light", 1.0),
        Level("medium", 3.0),
        # more than eu-west-1's two A10G pods can prefill within the SLO
        Level("heavy", 6.0),
        Level("bursty", 1.0, burst_rate=10.0, on_s=3.0, off_s=7.0),
    )
}


def workload(level: Level, duration: float, seed: int, run: int = 0) -> list[RequestSpec]:
    """The level's requests, seeded: every front gets the very same arrivals, lengths and
    texts, each prompt led by its own `run` number (fixed width, so the same length):
    a region's prefix cache keeps nothing of another front's run of the same list."""
    rng = random.Random(f"{seed}-{level.name}")
    corpus = Corpus(random.Random(f"{seed}-{level.name}-text"), chars=400_000)
    specs = []
    for i, at in enumerate(level.arrivals(rng, duration)):
        prompt = lognormal(rng, PROMPT_MEDIAN, PROMPT_SIGMA, *PROMPT_RANGE)
        output = lognormal(rng, OUTPUT_MEDIAN, OUTPUT_SIGMA, *OUTPUT_RANGE)
        # the run and the index first: no two prompts share a cached prefix
        user = f"{run:03d}-{i:05d} {corpus.text_of(prompt)}"
        specs.append(RequestSpec(index=i, at=at, model=LLAMA, pool=LLAMA,
                                 body=chat_body(LLAMA, user, output),
                                 prompt_tokens=chat_prompt_tokens(user), max_tokens=output))
    return specs


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(results: list[Result], slo_s: float = SLO_S) -> dict[str, Any]:
    """One front at one level: SLO share, TTFT percentiles, cost per million tokens, the
    share served per region. A failed request counts against the SLO, its tokens cost
    nothing (no region billed it)."""
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    within = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= slo_s)
    tokens = sum(r.prompt_tokens + r.output_tokens for r in ok)
    cost = sum((r.prompt_tokens + r.output_tokens) * PRICES.get(r.pod, math.nan) / 1e6
               for r in ok)
    regions = Counter(r.pod or "?" for r in ok)
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "within_slo_pct": 100.0 * within / len(results) if results else None,
        "ttft_p50_ms": None if not ttfts else 1000 * _pct(ttfts, 0.50),
        "ttft_p95_ms": None if not ttfts else 1000 * _pct(ttfts, 0.95),
        "ttft_p99_ms": None if not ttfts else 1000 * _pct(ttfts, 0.99),
        "tokens": tokens,
        "cost_usd": cost,
        "cost_per_million": 1e6 * cost / tokens if tokens else None,
        "regions": {name: regions[name] for name in sorted(regions)},
        "lateness_p99_ms": _pct([r.lateness_ms for r in results], 0.99),
        # every request, for a closer look: [arrival s, region, prompt tokens, TTFT ms]
        "samples": [[r.scheduled_s, r.pod, r.prompt_tokens,
                     None if r.ttft_s is None else round(1000 * r.ttft_s, 1)]
                    for r in results],
    }


# -- the topology --------------------------------------------------------------------


@dataclass
class World:
    """The demo and the extra fronts on its regions."""

    urls: dict[str, str]
    ca: Path
    status_url: str  # the demo router's /regions
    children: list[Child]


def _serve_fastest(work: Path, up_config: Path, certs, children: list[Child]) -> str:
    """A second global tier on the demo's regions, `fastest` for llama, the demo's
    certificate (one CA for every front)."""
    doc = yaml.safe_load(up_config.read_text())
    spec = doc["spec"]
    spec["models"] = [{**m, "policy": "fastest"} if m["name"] == LLAMA else m
                      for m in DEMO_MODELS]
    listen, picker, metrics, admin = free_ports(4)
    spec["listener"] = {"address": "127.0.0.1", "port": listen}
    spec["ports"] = {"picker": picker, "metrics": metrics, "envoyAdmin": admin}
    spec["tls"] = {"certificateFile": str(certs.cert), "keyFile": str(certs.key)}
    doc["metadata"]["name"] = "bench-fastest"
    state = work / "fastest"
    state.mkdir(parents=True, exist_ok=True)
    path = state / "global.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    child = start_piped("fastest", [*IGW, "global", "serve", "--config", str(path),
                                    "--state-dir", str(state)], log=state / "stderr.log")
    children.append(child)
    url = wait_line(child, lambda line: line.startswith("https://"), 90)
    child.drain()
    asyncio.run(regions_ready(metrics, len(DEMO_REGIONS)))
    return url


def _priority_front(work: Path, up_config: Path, certs, order: tuple[str, ...], name: str,
                    children: list[Child]) -> str:
    config = load_global_config(up_config)
    config = replace(config, tls=replace(config.tls, certificate_file=str(certs.cert),
                                         key_file=str(certs.key)))
    port, admin = free_ports(2)
    state = work / name
    bootstrap = render_priority_bootstrap(config, state, port, admin, order)
    start_envoy(bootstrap, admin, state, children)
    return f"https://127.0.0.1:{port}"


def start_world(work: Path, fronts: tuple[str, ...]) -> World:
    children: list[Child] = []
    try:
        (port,) = free_ports(1)
        up_state = work / "up"
        up = start_piped("global-up", [*IGW, "global", "up", "--port", str(port),
                                       "--state-dir", str(up_state)],
                         log=work / "global-up.log")
        children.append(up)
        url = wait_line(up, lambda line: line.startswith("https://"), 180)
        config_line = wait_line(up, lambda line: line.startswith("# config:"), 30)
        up.drain()
        up_config = Path(config_line.split(":", 1)[1].strip())
        certs = generated_files(up_state)
        metrics = load_global_config(up_config).metrics_port
        urls = {"cheapest-within-slo": url}
        if "fastest" in fronts:
            urls["fastest"] = _serve_fastest(work, up_config, certs, children)
        if "priority" in fronts:
            urls["priority"] = _priority_front(work, up_config, certs, PRIORITY_ORDER,
                                               "priority", children)
        if "priority-cheap" in fronts:
            urls["priority-cheap"] = _priority_front(work, up_config, certs, CHEAP_ORDER,
                                                     "priority-cheap", children)
        return World(urls, certs.ca_cert, f"http://127.0.0.1:{metrics}/regions", children)
    except BaseException:
        stop_world(children)
        raise


def stop_world(children: list[Child]) -> None:
    for child in reversed(children):
        child.stop(timeout=40)


def _regions(status_url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(status_url, timeout=5) as reply:
        return json.loads(reply.read())["regions"]


def settle(status_url: str, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
    """Until every region's pools are idle (nothing running, queued or committed); the
    seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        pools = [p for r in _regions(status_url) for p in r["pools"]]
        if all(p["running"] == 0 and p["queueLength"] == 0 and p["engineWaiting"] == 0
               and p["committedRequests"] == 0 for p in pools):
            return time.monotonic() - started
        time.sleep(0.25)
    raise TimeoutError(f"regions not idle after {timeout_s:g} s")


def idle_view(status_url: str) -> dict[str, dict[str, Any]]:
    """What the demo router knows of each idle region after the warm-up: its RTT and its
    summary's predicted TTFT of a typical llama request (the report shows both)."""
    out = {}
    for region in _regions(status_url):
        pool = next((p for p in region["pools"] if p["model"] == LLAMA), {})
        out[region["name"]] = {"rtt_s": region["rttS"],
                               "predicted_ttft_s": pool.get("predictedTtftS"),
                               "typical_prompt_tokens": pool.get("typicalPromptTokens")}
    return out


def _context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def drive(url: str, ca: Path, specs: list[RequestSpec], status_url: str | None = None
          ) -> tuple[list[Result], list[list[Any]]]:
    """The specs through one front, open loop, on fresh client connections; with
    `status_url`, what the demo router saw of each region meanwhile (every 0.5 s)."""
    path = f"{url}/v1/chat/completions"
    gen = LoadGenerator(specs, lambda _spec: path, ssl_context=_context(ca),
                        time_cap_s=max(s.at for s in specs) + TIME_CAP_S if specs else 1.0,
                        pod_header=hdr.REGION, clients=4)
    seen: list[list[Any]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(status_url, seen, stop), daemon=True)
    if status_url is not None:
        watcher.start()
    try:
        return asyncio.run(gen.run()), seen
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join(timeout=5)


def _watch(status_url: str, seen: list[list[Any]], stop: threading.Event) -> None:
    """[s since start, {region: [predicted TTFT s, prefill tokens/s, typical prompt,
    saturation, RTT s]}] every 0.5 s until `stop`."""
    started = time.monotonic()
    while not stop.wait(0.5) and len(seen) < 2000:
        try:
            regions = _regions(status_url)
        except (OSError, ValueError, KeyError):
            continue
        row = {}
        for region in regions:
            pool = next((p for p in region["pools"] if p["model"] == LLAMA), {})
            row[region["name"]] = [pool.get("predictedTtftS"), pool.get("prefillTokensPerS"),
                                   pool.get("typicalPromptTokens"), pool.get("saturation"),
                                   region["rttS"]]
        seen.append([round(time.monotonic() - started, 2), row])


def warm_regions(world: World, seed: int) -> None:
    """Every region's Tier-1 picker has fresh speeds for its pods (a speed not observed
    for 5 s is not trusted, picker.datastore.SPEED_STALE_S, and the summary then predicts
    a slower default): a few short requests pinned to each region with
    `x-gateway-regions`, so every front starts from the same knowledge of every region."""
    rng = random.Random(seed)
    corpus = Corpus(rng, chars=50_000)
    lengths = [lognormal(rng, PROMPT_MEDIAN, 0.3, 64, 800) for _ in range(WARM_PER_REGION)]
    bodies = [chat_body(LLAMA, f"warm {seed}-{i} {corpus.text_of(n)}", WARM_OUTPUT_TOKENS)
              for i, n in enumerate(lengths)]
    asyncio.run(_pinned(world, bodies))


async def _pinned(world: World, bodies: list[bytes]) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(ssl=_context(world.ca))
    timeout = aiohttp.ClientTimeout(total=60)
    url = f"{world.urls['cheapest-within-slo']}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(body: bytes, region: str, delay: float) -> None:
            await asyncio.sleep(delay)
            async with session.post(url, data=body, headers={
                    "content-type": "application/json", hdr.REGIONS: region}) as reply:
                await reply.read()

        await asyncio.gather(*(one(body, region.name, 0.3 * i)
                               for region in DEMO_REGIONS for i, body in enumerate(bodies)))


def run(world: World, fronts: tuple[str, ...], levels: list[Level], duration: float,
        seed: int, progress: bool = True, views: bool = False) -> list[dict[str, Any]]:
    """Every level, every front in turn on the same idle regions; one row per pair
    (`views`: with what the demo router saw of the regions during the run)."""
    rows: list[dict[str, Any]] = []
    warm = Level("warm", WARMUP_RATE)
    for li, level in enumerate(levels):
        for fi, front in enumerate(fronts):
            run_index = 1 + li * len(fronts) + fi  # every warm-up text unseen, too
            specs = workload(level, duration, seed, run_index)
            settle(world.status_url)
            drive(world.urls[front], world.ca, workload(warm, WARMUP_S, seed, run_index))
            warm_regions(world, seed + run_index)
            settle(world.status_url)
            if progress:
                print(f"global cost: {level.name} ({len(specs)} requests) via {front}",
                      flush=True)
            results, seen = drive(world.urls[front], world.ca, specs,
                                  world.status_url if views else None)
            rows.append({"level": level.name, "front": front, **summarize(results)})
            if views:
                rows[-1]["router_view"] = seen
        _relative(rows, level.name)
    return rows


def _relative(rows: list[dict[str, Any]], level: str) -> None:
    """Each front's cost per million tokens against `fastest` at the same level."""
    same = [r for r in rows if r["level"] == level]
    base = next((r["cost_per_million"] for r in same if r["front"] == "fastest"), None)
    for row in same:
        mine = row["cost_per_million"]
        row["cost_vs_fastest"] = mine / base if base and mine is not None else None


# -- the report -----------------------------------------------------------------------


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# Global routing cost: cheapest-within-slo against fastest and an Envoy priority "
        "front", "",
        f"{doc['date']}; `{doc['command']}`; {doc['cores']} cores shared with other work "
        f"(load average {doc['load_average']:.1f} at the end): the demo's nine simulated "
        "pods, three Tier-1 gateways, their delay proxies, the fronts and the client all "
        "share them, so a TTFT here includes CPU contention a real deployment would not "
        "have.", "",
        f"Topology: `igw global up` (us-east-1 2x H100 at {PRICES['us-east-1']:.2f}, "
        f"us-west-2 2x A100 at {PRICES['us-west-2']:.2f}, eu-west-1 2x A10G at "
        f"{PRICES['eu-west-1']:.2f} $ per million tokens; 10/70/90 ms RTT). SLO: TTFT "
        f"<= {SLO_S * 1000:.0f} ms at the client. Workload: streaming llama-3.1-8b chats, "
        f"prompts log-normal (median {PROMPT_MEDIAN} tokens, sigma {PROMPT_SIGMA}), "
        f"answers log-normal (median {OUTPUT_MEDIAN}, sigma {OUTPUT_SIGMA}), "
        f"{doc['duration_s']:g} s of seeded open-loop arrivals (seed {doc['seed']}), the "
        "same ones through every front (each prompt led by its run's number, so no front "
        "finds another's in a prefix cache). Cost = (prompt + completion tokens) x the serving "
        "region's price; a failed request counts as outside the SLO.", "",
        "Fronts: `cheapest-within-slo` and `fastest` are the global router (the demo's "
        "`igw global up`, and a second `igw global serve` on the same regions with "
        "`fastest`); `priority` is plain Envoy with one priority per region, us-east-1 "
        "first, then us-west-2, then eu-west-1 (bench/priority_front.py: TLS per region, "
        "health checks, outlier detection, retries to another priority on connect "
        "failure, reset or 5xx); `priority-cheap` the same with the cheapest region "
        "first.", "",
        "Idle, after the warm-up, the demo router saw: " + "; ".join(
            f"{name} RTT {v['rtt_s'] * 1000:.0f} ms, predicted TTFT "
            f"{_f(v['predicted_ttft_s'] and v['predicted_ttft_s'] * 1000, '.0f')} ms for a "
            f"{v['typical_prompt_tokens']}-token prompt"
            for name, v in doc.get("idle_view", {}).items()) + ".", "",
        "| level | front | requests | failed | within SLO | TTFT p50 ms | TTFT p95 ms "
        "| $ per M tokens | vs fastest | served by (us-east-1 / us-west-2 / eu-west-1) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["rows"]:
        level = LEVELS[row["level"]]
        share = " / ".join(
            f"{100 * row['regions'].get(r.name, 0) / max(row['requests'], 1):.0f} %"
            for r in DEMO_REGIONS)
        rel = row.get("cost_vs_fastest")
        lines.append(
            f"| {row['level']} ({level.describe()}) | {row['front']} | {row['requests']} | "
            f"{row['failed']} | {_f(row['within_slo_pct'], '.1f')} % | "
            f"{_f(row['ttft_p50_ms'], '.0f')} | {_f(row['ttft_p95_ms'], '.0f')} | "
            f"{_f(row['cost_per_million'], '.3f')} | "
            f"{'-' if rel is None else f'{100 * (rel - 1):+.0f} %'} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.global_cost")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds of arrivals per level and front")
    parser.add_argument("--levels", default=",".join(LEVELS),
                        help=f"comma list of: {', '.join(LEVELS)}")
    parser.add_argument("--fronts", default=",".join(FRONTS),
                        help=f"comma list of: {', '.join(FRONTS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rerender", action="store_true",
                        help="rewrite global-cost.md from the global-cost.json in --out")
    parser.add_argument("--views", action="store_true",
                        help="record what the demo router saw of each region every 0.5 s")
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: temp)")
    args = parser.parse_args(argv)
    if args.rerender:
        doc = json.loads((args.out / "global-cost.json").read_text())
        write_results(args.out, "global-cost", doc, render(doc))
        return 0
    levels = [LEVELS[name] for name in args.levels.split(",")]
    fronts = tuple(args.fronts.split(","))
    unknown = set(fronts) - set(FRONTS)
    if unknown:
        parser.error(f"unknown fronts: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory(prefix="igw-global-cost-") as tmp:
        work = args.work or Path(tmp)
        world = start_world(work, fronts)
        try:
            warm_regions(world, args.seed)
            settle(world.status_url)
            idle = idle_view(world.status_url)
            rows = run(world, fronts, levels, args.duration, args.seed, views=args.views)
        finally:
            stop_world(world.children)
    doc = {
        "date": utc_stamp(),
        "command": " ".join(["python -m bench.global_cost", *(argv or sys.argv[1:])]),
        "cores": os.cpu_count(), "load_average": os.getloadavg()[0],
        "duration_s": args.duration, "seed": args.seed, "slo_s": SLO_S,
        "prices": PRICES, "idle_view": idle, "rows": rows,
    }
    write_results(args.out, "global-cost", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
