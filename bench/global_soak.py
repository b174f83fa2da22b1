"""The global tier under a long steady load: is its memory bounded?

    python -m bench.global_soak [--minutes 10] [--rate 4]

The demo's topology (igw.global_gateway's `up_global_files` and `global_children`:
three regions, each a real Tier-1 gateway in front of simulated pods behind a delay
proxy, then the real global router and its Envoy), with the global body limit lowered
to 1 MiB so an oversized body is cheap to send. Open-loop load at `--rate` requests/s
for `--minutes`, a seeded mix of good requests (streaming and not, some with an
`x-gateway-regions` allow-list) and bad ones (malformed JSON, an unknown model, a body
over the limit, streams the client drops after the first chunk). Every ~10 s: RSS and
open fds of the router process and of the global Envoy, and the sizes of the router's
counters (`/regions`).

Pass: every good request answered 200 and complete; every bad one a 4xx (the expected
one), never a 5xx; RSS over the second half grows less than `RSS_BOUND_MIB` for each
process, fds less than `FD_BOUND`. Results: bench/results/global-soak.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil
import yaml

from bench.loadgen import send_open_loop, settle
from bench.output import utc_stamp, write_results
from contract import headers as hdr
from contract.config import load_config
from contract.global_config import load_global_config
from igw.gateway import wait_ready
from igw.global_gateway import DEMO_REGIONS, LLAMA, global_children, regions_ready, up_global_files
from igw.ports import free_port
from igw.supervisor import Supervisor

RESULTS = Path(__file__).resolve().parent / "results"
BODY_LIMIT = 1 << 20
SAMPLE_EVERY_S = 10.0
REQUEST_TIMEOUT_S = 30.0
MAX_OPEN = 64  # client-side bound on requests in flight
RSS_BOUND_MIB = {"router": 8.0, "envoy": 16.0}  # growth over the second half
FD_BOUND = 16
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# kind → share of the arrivals; the expected status of each bad kind
MIX = {"chat": 0.45, "stream": 0.25, "allow": 0.10, "drop": 0.05,
       "malformed": 0.05, "unknown": 0.05, "oversized": 0.05}
EXPECTED = {"malformed": 400, "unknown": 404, "oversized": 413}


def _kinds(count: int) -> list[str]:
    rng = random.Random(18)
    names, weights = zip(*MIX.items(), strict=True)
    return rng.choices(names, weights, k=count)


def _request(kind: str, i: int) -> tuple[bytes, dict[str, str]]:
    """Body and extra headers of the i-th request of `kind`."""
    text = f"soak request {i}: say something about region {i % 7}"
    doc: dict[str, Any] = {"model": LLAMA, "messages": [{"role": "user", "content": text}],
                           "max_tokens": 16}
    headers: dict[str, str] = {}
    if kind in ("stream", "drop"):
        doc["stream"] = True
    elif kind == "allow":
        headers[hdr.REGIONS] = "us-east-1,us-west-2"
    elif kind == "unknown":
        doc["model"] = "no-such-model"
    elif kind == "malformed":
        return b'{"model": "' + LLAMA.encode() + b'", "messages": [', headers
    elif kind == "oversized":
        doc["messages"][0]["content"] = "x" * (BODY_LIMIT + 1024)
    return orjson.dumps(doc), headers


@dataclasses.dataclass(slots=True)
class Outcome:
    kind: str
    status: int = 0  # 0: transport error
    complete: bool = False
    error: str = ""

    @property
    def good(self) -> bool:
        return self.kind in ("chat", "stream", "allow")

    @property
    def passed(self) -> bool:
        if self.good:
            return self.status == 200 and self.complete
        if self.kind == "drop":  # the client walked away: only a 200 start counts
            return self.status == 200
        return self.status == EXPECTED[self.kind]


async def _one(session: aiohttp.ClientSession, url: str, out: Outcome, body: bytes,
               headers: dict[str, str]) -> None:
    try:
        async with session.post(url, data=body, headers=headers) as reply:
            out.status = reply.status
            if out.kind == "drop":
                await reply.content.readany()
                reply.close()  # disconnect mid-stream
                return
            data = await reply.read()
            stream = out.kind == "stream"
            out.complete = reply.status == 200 and (
                data.rstrip().endswith(b"data: [DONE]") if stream else b'"choices"' in data)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]


async def _sample(pids: dict[str, int | None], status_url: str, t0: float,
                  session: aiohttp.ClientSession) -> dict[str, Any]:
    row: dict[str, Any] = {"t": round(time.monotonic() - t0, 1)}
    for name, pid in pids.items():
        proc = psutil.Process(pid)
        row[f"{name}_rss_mib"] = round(proc.memory_info().rss / 2**20, 2)
        row[f"{name}_fds"] = proc.num_fds()
    try:
        async with session.get(status_url) as reply:
            doc = await reply.json()
        row["placed_keys"] = len(doc.get("placed", {}))
        row["refused_keys"] = len(doc.get("refused", {}))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        row["placed_keys"] = row["refused_keys"] = -1
    return row


async def soak(minutes: float, rate: float, state_dir: Path) -> dict[str, Any]:
    port = free_port()
    global_path, region_children, region_configs = up_global_files(state_dir, port)
    doc = yaml.safe_load(global_path.read_text())
    doc["spec"]["bbr"] = {"maxRequestBodyBytes": BODY_LIMIT}
    global_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    config = load_global_config(global_path)
    tier2 = global_children(global_path, state_dir, None, log_level="WARNING")
    for spec in tier2:
        spec.stdout_to_stderr = True  # the Envoy access log: not our report
    supervisor = Supervisor([*region_children, *tier2])

    async def ready_then_load() -> dict[str, Any]:
        await asyncio.gather(*(wait_ready(load_config(p)) for p in region_configs))
        await wait_ready(config)
        await regions_ready(config.metrics_port, len(DEMO_REGIONS))
        pids = {name: supervisor.child(child).pid for name, child in
                (("router", "globalrouter"), ("envoy", "envoy"))}
        return await _load(config.listen_port, config.metrics_port, state_dir, pids,
                           minutes, rate)

    # Ctrl-C or SIGTERM ends the run, not the process: every child is still stopped
    loop = asyncio.get_running_loop()
    await supervisor.start()
    run = asyncio.create_task(ready_then_load())
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, run.cancel)
    try:
        return await run
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        await supervisor.stop()


async def _load(listen: int, metrics: int, state_dir: Path, pids: dict[str, int | None],
                minutes: float, rate: float) -> dict[str, Any]:
    url = f"https://127.0.0.1:{listen}/v1/chat/completions"
    status_url = f"http://127.0.0.1:{metrics}/regions"
    tls = ssl.create_default_context(cafile=str(state_dir / "tls" / "ca.pem"))
    duration = minutes * 60.0
    kinds = _kinds(int(rate * duration))
    outcomes: list[Outcome] = []
    samples: list[dict[str, Any]] = []
    skipped = 0
    open_now = 0
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(ssl=tls, limit=MAX_OPEN)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as status:
        t0 = time.monotonic()
        samples.append(await _sample(pids, status_url, t0, status))

        async def sampler() -> None:
            while True:
                await asyncio.sleep(SAMPLE_EVERY_S)
                samples.append(await _sample(pids, status_url, t0, status))

        async def send(i: int, _due: float) -> None:
            nonlocal open_now
            out = Outcome(kinds[i])
            outcomes.append(out)
            body, headers = _request(out.kind, i)
            open_now += 1
            try:
                await _one(session, url, out, body,
                           {"content-type": "application/json", **headers})
            finally:
                open_now -= 1

        def skip(_i: int, _due: float) -> None:
            nonlocal skipped
            skipped += 1

        sampling = asyncio.create_task(sampler())
        try:
            tasks = await send_open_loop((t0 + i / rate for i in range(len(kinds))), send,
                                         full=lambda: open_now >= MAX_OPEN, on_full=skip)
            await settle(tasks.values(), time.monotonic() + REQUEST_TIMEOUT_S + 5)
            samples.append(await _sample(pids, status_url, t0, status))
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
    return _verdict(outcomes, samples, skipped, minutes, rate)


def _growth(samples: list[dict[str, Any]], key: str) -> float:
    """Over the second half: the mean of its last three samples minus its first three."""
    half = samples[len(samples) // 2:]
    head, tail = half[:3], half[-3:]
    return sum(s[key] for s in tail) / len(tail) - sum(s[key] for s in head) / len(head)


def _verdict(outcomes: list[Outcome], samples: list[dict[str, Any]], skipped: int,
             minutes: float, rate: float) -> dict[str, Any]:
    by_kind: dict[str, Counter[str]] = {}
    for out in outcomes:
        by_kind.setdefault(out.kind, Counter())[str(out.status) if out.status else out.error
                                                 .split(":")[0]] += 1
    failed_good = [o for o in outcomes if o.good and not o.passed]
    bad_5xx = [o for o in outcomes if not o.good and o.status >= 500]
    wrong_bad = [o for o in outcomes if not o.good and not o.passed]
    growth = {f"{name}_rss_mib": round(_growth(samples, f"{name}_rss_mib"), 2)
              for name in RSS_BOUND_MIB}
    fds = {f"{name}_fds": round(_growth(samples, f"{name}_fds"), 1) for name in RSS_BOUND_MIB}
    checks = {
        "0 failed good requests": not failed_good,
        "0 5xx for bad client input": not bad_5xx,
        "every bad input its 4xx": not wrong_bad,
        **{f"{n} RSS growth (second half) < {b:g} MiB": growth[f"{n}_rss_mib"] < b
           for n, b in RSS_BOUND_MIB.items()},
        **{f"{n} fds growth (second half) < {FD_BOUND}": fds[f"{n}_fds"] < FD_BOUND
           for n in RSS_BOUND_MIB},
        "no arrival skipped": skipped == 0,
    }
    return {
        "minutes": minutes, "rate": rate, "requests": len(outcomes), "skipped": skipped,
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failed_good": [dataclasses.asdict(o) for o in failed_good[:20]],
        "growth_second_half": {**growth, **fds}, "samples": samples, "checks": checks,
        "passed": all(checks.values()),
    }


def _commit() -> str:
    """The checkout's commit, for the report (unknown outside a git checkout)."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).parent, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip()


def render(doc: dict[str, Any], command: str) -> str:
    first, last = doc["samples"][0], doc["samples"][-1]
    lines = [
        "# Global tier soak",
        "",
        f"`{command}` ({doc['date']}, commit {doc['commit']}; a shared, loaded 2-core "
        "machine: other work ran beside it, so absolute figures are noisy; the criterion is "
        "growth, not level).",
        "",
        f"Topology: `igw global up`'s (three Tier-1 regions behind delay proxies, the global "
        f"router and its Envoy), global body limit 1 MiB. {doc['requests']} requests in "
        f"{doc['minutes']:g} min at {doc['rate']:g}/s, open loop; mix {MIX}.",
        "",
        "| kind | answers |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in doc["by_kind"].items()),
        "",
        "| process | RSS first → last (MiB) | RSS growth, second half | fds first → last |",
        "| --- | --- | --- | --- |",
    ]
    growth = doc["growth_second_half"]
    for name in RSS_BOUND_MIB:
        lines.append(
            f"| {name} | {first[f'{name}_rss_mib']} → {last[f'{name}_rss_mib']} | "
            f"{growth[f'{name}_rss_mib']:+.2f} MiB | {first[f'{name}_fds']} → "
            f"{last[f'{name}_fds']} |")
    lines += ["", f"Router counters (`/regions` placed/refused keys) at the end: "
              f"{last['placed_keys']} / {last['refused_keys']}.", "", "Checks:", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in doc["checks"].items()]
    lines += ["", f"**{'PASSED' if doc['passed'] else 'FAILED'}**", "",
              "Samples (every ~10 s) are in global-soak.json."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.global_soak")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 120 or not 0 < args.rate <= 50:
        parser.error("--minutes in (0, 120], --rate in (0, 50]")
    commit = _commit()  # what the processes run: taken before they start
    with tempfile.TemporaryDirectory(prefix="igw-global-soak-") as tmp:
        try:
            doc = asyncio.run(soak(args.minutes, args.rate, Path(tmp)))
        except asyncio.CancelledError:
            print("interrupted: no result written", file=sys.stderr)
            return 130
    doc["date"] = utc_stamp()
    doc["commit"] = commit
    command = f"python -m bench.global_soak --minutes {args.minutes:g} --rate {args.rate:g}"
    write_results(args.out, "global-soak", doc, render(doc, command))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
