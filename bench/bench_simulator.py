"""How much the simulator costs, and how big a fleet it runs on this machine in real time.

    python -m bench.bench_simulator [--quick]

For each (pods, request rate) step it launches the simulator CLI as its own process, drives
it from this process with open-loop Poisson arrivals of streamed chat requests, and reports:
- the simulator's CPU per request (its /proc CPU time over the load window / requests);
- its fidelity: per request, how late the first token reached the socket compared with the
  engine's own model time (every pod's /admin/lateness samples, pooled);
- client-side TTFT next to the model's mean TTFT, for reference (includes this load
  generator's own event-loop delay on the same 2 cores).
A step is *sustained* when every request succeeds and the p95 lateness is within 1 ms of
the machine's own timer noise (a probe process measured alongside).
The ladder stops at the first step that is not sustained. Results go to
bench/results/simulator.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.procs import Child, cpu_seconds, free_port_base, start_piped, wait_line

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "simulator.md"
GPU_MIX = ("h100", "a100", "l40s", "a10g")
LADDER = ((4, 20), (8, 40), (16, 40), (16, 80), (16, 160), (16, 240), (16, 320))
QUICK_LADDER = ((4, 20), (16, 80))
LOAD_SECONDS = 5.0
MAX_IN_FLIGHT = 2000
LATENESS_LIMIT_MS = 1.0
READY_TIMEOUT_S = 20.0
WARM_UP_PER_POD = 2
ATTEMPTS = 2  # a step that misses is run once more: the machine is shared and noisy


@dataclass
class StepResult:
    pods: int
    rate: float
    requests: int
    failures: int
    sim_cpu_s: float
    loadgen_cpu_s: float
    tokens: int
    load_avg: float
    lateness_p50_ms: float
    lateness_p95_ms: float
    lateness_p99_ms: float
    lateness_max_ms: float
    client_ttft_ms: float
    model_ttft_ms: float
    noise_p95_ms: float = 0.0

    @property
    def sustained(self) -> bool:
        return (self.failures == 0
                and self.lateness_p95_ms <= LATENESS_LIMIT_MS + self.noise_p95_ms)

    @property
    def cpu_per_request_us(self) -> float:
        return 1e6 * self.sim_cpu_s / max(1, self.requests)


PROBE = """
import asyncio, json, random, sys
from simulator import clock
async def sleeper(seconds, lags):
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        duration = random.uniform(0.01, 0.05)
        due = loop.time() + duration
        await asyncio.sleep(duration - 0.0002)
        lags.append((loop.time() - due) * 1000)
async def probe(seconds, count):
    lags = []
    await asyncio.gather(*(sleeper(seconds, lags) for _ in range(count)))
    print(json.dumps(sorted(lags)))
clock.run(probe(float(sys.argv[1]), int(sys.argv[2])))
"""


def start_probe(seconds: float, pods: int) -> Child:
    """A separate process with one timer per pod sleeping like an engine iteration (10-50 ms,
    waking 0.2 ms early) and doing no work: how late this machine wakes such a process during
    the step (other processes share these cores; long sleeps wake later than short ones).
    Its one line of output, the sorted lags in ms, comes when it is done."""
    return start_piped("timer probe", [sys.executable, "-c", PROBE, str(seconds), str(pods)],
                       cwd=REPO)


def fleet_yaml(pods: int, base: int) -> str:
    lines = ["seed: 1", "pods:"]
    for i in range(pods):
        lines.append(f"  - {{name: pod-{i}, gpu: {GPU_MIX[i % len(GPU_MIX)]}, "
                     f"model: llama-3.1-8b, port: {base + i}}}")
    return "\n".join(lines) + "\n"


def sim_cpu_s(sim: Child) -> float:
    """utime + stime of the simulator process; it must still be running."""
    seconds = cpu_seconds(sim.pid)
    if seconds is None:
        raise RuntimeError(f"simulator exited ({sim.proc.poll()}) during the step")
    return seconds


def launch(fleet_file: str) -> Child:
    """The simulator on a fleet file; its first line must be the ready line."""
    sim = start_piped("simulator", [sys.executable, "-m", "simulator", "--fleet", fleet_file],
                      log=Path(os.devnull), cwd=REPO)
    line = wait_line(sim, lambda _: True, READY_TIMEOUT_S)
    if not line.startswith("simulator ready"):
        sim.stop()
        raise RuntimeError(f"simulator did not start: {line!r}")
    return sim


def request_bodies(seed: int, count: int) -> list[bytes]:
    """Chat requests over 8 shared ~800-character system prompts (prefix-cache hits) with
    unique user text, 16-64 output tokens."""
    rng = random.Random(seed)
    systems = [f"system prompt {k}: " + "policy text " * 66 for k in range(8)]
    return [
        orjson.dumps({
            "model": "llama-3.1-8b", "stream": True, "max_tokens": rng.randint(16, 64),
            "messages": [{"role": "system", "content": rng.choice(systems)},
                         {"role": "user",
                          "content": f"question {i} " + "x" * rng.randint(50, 400)}],
        })
        for i in range(count)
    ]


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes) -> float | None:
    """Client-side TTFT (first body bytes = first token), or None on failure."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                return None
            ttft = None
            async for _ in resp.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
            return ttft
    except (TimeoutError, aiohttp.ClientError):
        return None


async def drive(urls: list[str], rate: float, seconds: float, seed: int) -> list[float | None]:
    """Open-loop Poisson arrivals spread round-robin over the pods."""
    rng = random.Random(seed)
    bodies = request_bodies(seed, int(rate * seconds * 1.5) + 10)
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[float | None]] = []
        start = loop.time()
        next_at = start
        i = 0
        while next_at < start + seconds and i < len(bodies):
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if sum(1 for t in tasks if not t.done()) < MAX_IN_FLIGHT:
                tasks.append(asyncio.create_task(
                    one_request(session, urls[i % len(urls)], bodies[i])))
            i += 1
            next_at += rng.expovariate(rate)
        return list(await asyncio.gather(*tasks))


async def warm_up(urls: list[str]) -> None:
    """A few requests per pod before measuring: first-use code paths and connections."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        bodies = request_bodies(0, WARM_UP_PER_POD)
        await asyncio.gather(*(one_request(session, u, b) for u in urls for b in bodies))


async def pod_states(base: int, pods: int) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """Each pod's /admin/state and its lateness samples."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        states: list[dict[str, Any]] = []
        lateness: list[list[float]] = []
        for port in range(base, base + pods):
            async with session.get(f"http://127.0.0.1:{port}/admin/state") as r:
                states.append(await r.json())
            async with session.get(f"http://127.0.0.1:{port}/admin/lateness") as r:
                lateness.append(await r.json())
        return states, lateness


def run_step(pods: int, rate: float, seconds: float) -> StepResult:
    base = free_port_base(pods)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(fleet_yaml(pods, base))
        fleet_file = f.name
    sim = launch(fleet_file)
    try:
        urls = [f"http://127.0.0.1:{base + i}/v1/chat/completions" for i in range(pods)]
        asyncio.run(warm_up(urls))
        states0, before = asyncio.run(pod_states(base, pods))
        load_avg = os.getloadavg()[0]
        probe = start_probe(seconds, pods)
        cpu0, own0 = sim_cpu_s(sim), time.process_time()
        ttfts = asyncio.run(drive(urls, rate, seconds, seed=pods * 1000 + int(rate)))
        cpu1, own1 = sim_cpu_s(sim), time.process_time()
        noise = orjson.loads(wait_line(probe, lambda _: True, 30))
        probe.stop()
        states, after = asyncio.run(pod_states(base, pods))
    finally:
        sim.stop()
        os.unlink(fleet_file)
    lateness = sorted(x for old, new in zip(before, after, strict=True) for x in new[len(old):])
    result = summarize(pods, rate, ttfts, states0, states, lateness, cpu1 - cpu0, own1 - own0,
                       load_avg)
    result.noise_p95_ms = percentile(noise, 0.95)
    return result


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def total(states: list[dict[str, Any]], *path: str) -> float:
    """Sum over pods of one (nested) figure of /admin/state."""
    out = 0.0
    for state in states:
        value: Any = state
        for key in path:
            value = value[key]
        out += value
    return out


def summarize(pods: int, rate: float, ttfts: list[float | None],
              states0: list[dict[str, Any]], states: list[dict[str, Any]],
              lateness: list[float], sim_cpu: float, own_cpu: float,
              load_avg: float) -> StepResult:
    """One step's figures; engine counters are differences across the load window."""
    ok = [t for t in ttfts if t is not None]

    def delta(*path: str) -> float:
        return total(states, *path) - total(states0, *path)

    return StepResult(
        pods=pods, rate=rate, requests=len(ok), failures=len(ttfts) - len(ok),
        sim_cpu_s=sim_cpu, loadgen_cpu_s=own_cpu,
        tokens=int(delta("generation_tokens")),
        load_avg=load_avg,
        lateness_p50_ms=percentile(lateness, 0.5),
        lateness_p95_ms=percentile(lateness, 0.95),
        lateness_p99_ms=percentile(lateness, 0.99),
        lateness_max_ms=lateness[-1] if lateness else 0.0,
        client_ttft_ms=1000 * statistics.fmean(ok) if ok else 0.0,
        model_ttft_ms=1000 * delta("histograms", "ttft", "sum")
        / max(1.0, delta("histograms", "ttft", "count")),
    )


def table(results: list[StepResult]) -> str:
    head = ("| pods | rate (req/s) | requests | failed | sim CPU / req (µs) | sim CPU (% of a core)"
            " | tokens/s | sim CPU / token (µs) | load-gen CPU (% of a core) | load avg"
            " | noise p95 (ms)"
            " | lateness p50 / p95 / p99 / max (ms) | client TTFT mean (ms)"
            " | model TTFT mean (ms) | sustained |\n|" + " --- |" * 15)
    rows = [
        f"| {r.pods} | {r.rate:g} | {r.requests} | {r.failures} | {r.cpu_per_request_us:.0f} | "
        f"{100 * r.sim_cpu_s / LOAD_SECONDS:.0f} | {r.tokens / LOAD_SECONDS:.0f} | "
        f"{1e6 * r.sim_cpu_s / max(1, r.tokens):.0f} | "
        f"{100 * r.loadgen_cpu_s / LOAD_SECONDS:.0f} | "
        f"{r.load_avg:.1f} | {r.noise_p95_ms:.2f} | "
        f"{r.lateness_p50_ms:.2f} / {r.lateness_p95_ms:.2f} / {r.lateness_p99_ms:.2f} / "
        f"{r.lateness_max_ms:.2f} | "
        f"{r.client_ttft_ms:.1f} | {r.model_ttft_ms:.1f} | {'yes' if r.sustained else 'no'} |"
        for r in results
    ]
    return "\n".join([head, *rows])


def report(results: list[StepResult], quick: bool) -> str:
    best = max((r for r in results if r.sustained), key=lambda r: (r.pods * r.rate), default=None)
    verdict = (f"Largest sustained step: **{best.pods} pods × {best.rate:g} req/s** "
               f"({best.cpu_per_request_us:.0f} µs simulator CPU per request)."
               if best else "No step was sustained.")
    return (
        "# Simulator benchmark\n\n"
        f"`python -m bench.bench_simulator{' --quick' if quick else ''}` on {os.cpu_count()} "
        f"cores, {time.strftime('%Y-%m-%d')}. Each step: {LOAD_SECONDS:g} s of open-loop Poisson "
        "arrivals of streamed chat requests (16-64 output tokens, 8 shared system prompts) "
        "round-robin over a fleet of h100/a100/l40s/a10g pods serving llama-3.1-8b, the "
        "simulator in its own process, the load generator in this one.\n\n"
        "- *lateness*: per request, wall time between the engine's model time for the first "
        "token and the moment it was written to the socket, pooled over all pods. "
        "p99 and max are single samples at a few hundred requests per step.\n"
        "- *noise p95*: a separate process with one timer per pod, sleeping 10-50 ms like an "
        "engine iteration on the same precise loop and doing no work: how late this machine "
        "wakes such a process during the step (other processes share these cores).\n"
        f"- *sustained*: no failed request and lateness p95 <= {LATENESS_LIMIT_MS:g} ms + noise "
        "p95, i.e. the simulator adds at most 1 ms to what the machine itself imposes.\n"
        "- *client TTFT* includes this load generator's own event-loop delay; *model TTFT* is "
        "the engine's own figure (vllm:time_to_first_token_seconds mean).\n"
        "- *load avg*: the machine's 1-minute load average when the step started (other "
        "processes share these cores); a step that misses is run once more.\n\n"
        f"{table(results)}\n\n{verdict}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two steps only")
    args = parser.parse_args(argv)
    results: list[StepResult] = []
    deadline = time.monotonic() + 100.0
    for pods, rate in QUICK_LADDER if args.quick else LADDER:
        if time.monotonic() > deadline:
            break
        for _ in range(ATTEMPTS):
            result = run_step(pods, rate, LOAD_SECONDS)
            results.append(result)
            print(table([result]).splitlines()[-1], flush=True)
            if result.sustained or time.monotonic() > deadline:
                break
        if not result.sustained:
            break
    text = report(results, args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
