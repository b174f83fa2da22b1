"""How fast the admission queue releases waiters while the event loop is busy.

    python -m bench.admission_release [--waiters 400] [--busy-ms 0.5] [--repeats 5]

A pool's queue holds `--waiters` requests; then room opens for all of them at once
(the saturation switch flips, as when a pod's batch drains) and the queue is told.
Two ways a release can dispatch: the caller dispatches when its task resumes (the
queue grants one waiter, then waits for that dispatch before judging the next: two
loop iterations per waiter), or the queue runs the dispatch inside the release
(`on_grant`, what the director passes) and goes on with the next at once. Meanwhile
`--busy` other tasks each spend `--busy-ms` of CPU per loop iteration, as the
picker's other streams do under load. Measured: time from the flip until every
waiter is dispatched, and releases per second. Best of `--repeats`, both ways
interleaved. Writes bench/results/admission-release.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import time
from pathlib import Path

import numpy as np

from contract.config import SaturationConfig, SchedulerConfig
from picker.datastore import Pool
from picker.scheduling import AdmissionQueue, SchedulingRequest

RESULTS = Path(__file__).resolve().parent / "results"


def _pool(waiters: int) -> Pool:
    sat = SaturationConfig(queue_size=waiters, queue_timeout_s=600.0)
    pool = Pool(SchedulerConfig(name="p", model_name="m", endpoints=("10.0.0.1:8000",),
                                saturation=sat))
    pool.set_members(("10.0.0.1:8000",))
    return pool


async def _busy(stop: asyncio.Event, busy_s: float) -> None:
    """Another stream's work: `busy_s` of CPU, then yield, until told to stop."""
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        await asyncio.sleep(0)


async def _one(waiters: int, busy: int, busy_s: float, in_release: bool) -> float:
    """Seconds from the flip until all `waiters` are dispatched."""
    saturated = [True]
    queue = AdmissionQueue(_pool(waiters), saturated=lambda now: saturated[0])
    req = SchedulingRequest("m", None, 100, 16, np.empty(0, np.uint64), 0)
    done: list[float] = []

    async def client() -> None:
        stamp = done.append
        dispatched = await queue.acquire(
            req, on_grant=(lambda: stamp(time.perf_counter())) if in_release else None)
        if not dispatched:
            stamp(time.perf_counter())
            queue.notify()  # what the dispatch's listener call does

    clients = [asyncio.create_task(client()) for _ in range(waiters)]
    await asyncio.sleep(0.01)
    stop = asyncio.Event()
    others = [asyncio.create_task(_busy(stop, busy_s)) for _ in range(busy)]
    await asyncio.sleep(0.01)
    saturated[0] = False
    flipped = time.perf_counter()
    queue.notify()
    await asyncio.gather(*clients)
    stop.set()
    await asyncio.gather(*others)
    queue.close()
    return max(done) - flipped


def run(waiters: int, busy: int, busy_ms: float, repeats: int) -> dict:
    results: dict[str, list[float]] = {"resume": [], "in-release": []}
    for _ in range(repeats):
        for name, in_release in (("resume", False), ("in-release", True)):
            results[name].append(asyncio.run(_one(waiters, busy, busy_ms / 1000, in_release)))
    return {name: min(v) for name, v in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admission_release")
    p.add_argument("--waiters", type=int, default=400)
    p.add_argument("--busy", type=int, default=8, help="other tasks on the loop")
    p.add_argument("--busy-ms", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    for busy in (0, args.busy):
        best = run(args.waiters, busy, args.busy_ms, args.repeats)
        rows.append((busy, best))
        print(f"busy tasks {busy}: " + ", ".join(
            f"{k} {v * 1000:.1f} ms ({args.waiters / v:,.0f}/s)" for k, v in best.items()))
    lines = [
        "# Admission releases on a busy event loop",
        "",
        f"`python -m bench.admission_release --waiters {args.waiters} --busy {args.busy} "
        f"--busy-ms {args.busy_ms:g} --repeats {args.repeats}` on "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores shared with "
        f"other work (load average {os.getloadavg()[0]:.1f}). {args.waiters} waiters; room "
        "opens for all at once; time until every one is dispatched, best of "
        f"{args.repeats}, both ways interleaved. Method: bench/admission_release.py.",
        "",
        "| other tasks on the loop (each " + f"{args.busy_ms:g} ms per iteration) "
        "| caller dispatches on resume | dispatch inside the release (`on_grant`) | ratio |",
        "| ---: | --- | --- | ---: |",
    ]
    for busy, best in rows:
        r, g = best["resume"], best["in-release"]
        lines.append(f"| {busy} | {r * 1000:.1f} ms ({args.waiters / r:,.0f}/s) "
                     f"| {g * 1000:.1f} ms ({args.waiters / g:,.0f}/s) | {r / g:.0f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admission-release.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
