"""Scoring cost per request: the vectorized scheduler vs a pure-Python twin.

    python -m bench.bench_scoring [--quick]

For 10 / 100 / 1,000 / 10,000 pods, a pool with mixed load and speeds and a
prefix index filled by simulated past traffic (32 shared system prompts of
512 tokens, multi-turn conversations on top), the `llm-d` profile picks a
pod for a ~2k-token prompt (128 blocks) that continues a conversation one pod
has already served. The pure-Python implementation below computes the same
scores with lists, dicts and per-pod loops (what one would write first);
both must choose the same pod. Timing: best of several repeats (the machine
is shared), per pick. Writes bench/results/scoring.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import tracemalloc
from functools import partial
from pathlib import Path

import numpy as np

from contract.config import SaturationConfig, SchedulerConfig
from picker.datastore import Pool
from picker.scheduling import Scheduler, SchedulingRequest
from picker.scheduling.prefix_index import PrefixIndex
from picker.scheduling.profiles import PROFILES
from picker.scheduling.scorers.latency import DEFAULT_BATCH_CAPACITY, NEAR_BEST
from picker.scheduling.state import (
    DEFAULT_OUTPUT_TOKENS,
    PROBE_AFTER_KNOWN,
    SPEED_CLASS_RATIO,
)

PREFIX_TTFT_RATIO = PROFILES["llm-d"].params["prefix"]["max_ttft_ratio"]

SIZES = (10, 100, 1_000, 10_000)
PROMPT_BLOCKS = 128  # 2,048 tokens × 4 chars / 64-char blocks
SYSTEM_BLOCKS = 32
SYSTEM_PROMPTS = 32
RESULTS = Path(__file__).parent / "results" / "scoring.md"
ADAPTERS = 8  # the adapter column's pool: 8 adapters on 2 slots per pod
ADAPTER_SLOTS = 2


# -- the workload ----------------------------------------------------------------------


def chain(seed: int, n: int, parent: list[int] | None = None) -> list[int]:
    """n chained 63-bit block hashes continuing `parent` (stand-in for bbr.prefix)."""
    rng = np.random.default_rng(seed)
    return [*(parent or []), *rng.integers(1, 2**63, n).tolist()]


def build_pool(n: int, seed: int = 7, adapters: int = 0,
               prefill_clock: bool = True) -> tuple[Pool, Scheduler, SchedulingRequest, float]:
    """The pool and request every column is timed on. `adapters` > 0: the pool serves
    that many LoRA adapters (vLLM pages, `ADAPTER_SLOTS` each, a random one running on
    each pod) and the request asks for the first; `prefill_clock=False`: the pages have no
    prompt counter (SGLang: the latency model's prefill-due floor is computed)."""
    endpoints = tuple(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000" for i in range(n))
    names = tuple(f"adapter-{a}" for a in range(adapters))
    # no flow control: the pure-Python twin has none, and its room filter would drop pods
    pool = Pool(SchedulerConfig(name="bench", model_name="m", endpoints=endpoints,
                                lora_adapters=names,
                                saturation=SaturationConfig(max_start_delay_s=0.0)))
    pool.set_members(endpoints)
    rng = np.random.default_rng(seed)
    now = 1000.0
    t = pool.table
    for row in range(n):
        pool.mark_scrape(row, True, now - rng.uniform(0, 0.05))
    t.waiting[:n] = rng.integers(0, 12, n)
    t.running[:n] = rng.integers(0, 64, n)
    t.kv_usage[:n] = rng.uniform(0, 0.95, n)
    t.prefill_tps[:n] = rng.uniform(4_000, 20_000, n)
    # the engines count their prefix-cache hits: prompts they have not seen prefill slower
    t.prefill_tps_uncached[:n] = t.prefill_tps[:n] * rng.uniform(0.1, 0.5, n)
    t.raw_cache_queries[:n] = 1e6
    t.decode_step_s[:n] = rng.uniform(0.01, 0.05, n)
    unknown = rng.random(n) < 0.1  # pods whose speed is not learned yet
    t.prefill_tps[:n][unknown] = 0.0
    t.decode_step_s[:n][unknown] = 0.0
    t.ready[rng.integers(0, n, max(1, n // 50))] = False
    if not prefill_clock:
        t.prompt_tokens_total[:n] = np.nan
    if adapters:
        t.max_lora[:n] = ADAPTER_SLOTS
        t.lora_running[np.arange(n), rng.integers(0, adapters, n)] = True
    sched = Scheduler(pool, max_fallbacks=2, rng=np.random.default_rng(seed))
    systems = [chain(1000 + s, SYSTEM_BLOCKS) for s in range(SYSTEM_PROMPTS)]
    past = min(20 * n, 20_000)
    for i in range(past):
        row = int(rng.integers(n))
        prompt = chain(i, int(rng.integers(4, 80)), systems[i % SYSTEM_PROMPTS])
        req = SchedulingRequest("m", None, len(prompt) * 16, 200, np.array(prompt, np.uint64))
        sched.on_dispatch(row, req, now - 1.0, cached=float(rng.uniform(0.0, 0.9)))
    # The request continues a conversation that pod `n // 2` served 96 blocks of.
    history = chain(99_998, 96 - SYSTEM_BLOCKS, systems[0])
    served = SchedulingRequest("m", None, len(history) * 16, 200, np.array(history, np.uint64))
    sched.on_dispatch(n // 2, served, now - 1.0)
    for row in range(n):
        pool.mark_scrape(row, True, now - rng.uniform(0, 0.05))  # scrapes after that traffic
    t.ready[n // 2] = True
    prompt = chain(99_999, PROMPT_BLOCKS - len(history), history)
    adapter = names[0] if names else None
    request = SchedulingRequest("m", adapter, 2048, 256, np.array(prompt, np.uint64))
    return pool, sched, request, now


# -- the pure-Python twin ----------------------------------------------------------------


def python_pick(
    pool: Pool, sched: Scheduler, req: SchedulingRequest, now: float
) -> tuple[int, list[float]]:
    """Same filters, scores and weights as the llm-d profile, one pod at a time.

    Inputs are read into plain Python structures first (not timed): this is
    the cost of the scoring itself, as a straightforward implementation.
    """
    return _python_score(_python_inputs(pool, sched), req, now)


def _python_inputs(pool: Pool, sched: Scheduler) -> dict:
    t = pool.table
    n = len(pool.row_address)
    state = sched.state
    lru_sets = {row: set(state.prefix._lru.get(row, ())) for row in range(n)}
    cols = ("valid", "ready", "draining", "metrics_ok", "scraped_at", "waiting", "running",
            "kv_usage", "prefill_tps", "prefill_tps_uncached", "decode_step_s", "dispatched",
            "last_picked_at", "inflight")
    data = {c: getattr(t, c)[:n].tolist() for c in cols}
    data.update(
        n=n, sets=lru_sets, since=state.since_uncached[:n].tolist(),
        pace=state.observed_pace()[:n].tolist(),
        backlog=state.backlog_uncached_work(slice(0, n)).tolist(),
        demand=state.demand,
        mean_prompt=state.mean_prompt, mean_output=state.mean_output or DEFAULT_OUTPUT_TOKENS,
        stale=pool.config.metrics.stale_after_s, weights=sched.profile.weights,
    )
    return data


def _minmax_inv(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [1.0] * len(values) if hi - lo <= 0 else [(hi - v) / (hi - lo) for v in values]


def _median_pos(values: list[float], default: float) -> float:
    known = [v for v in values if v > 0]
    return statistics.median(known) if known else default


def _slow(d: dict, r: int, ref_pace: float) -> float:
    return d["pace"][r] / ref_pace if ref_pace > 0 and d["pace"][r] > 0 else 1.0


def _python_speed_classes(tps: dict[int, float]) -> dict[int, float]:
    """Each run of sorted speeds without a gap wider than SPEED_CLASS_RATIO gets its median."""
    rows = sorted(tps, key=tps.__getitem__)
    out: dict[int, float] = {}
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or tps[rows[i]] > tps[rows[i - 1]] * SPEED_CLASS_RATIO:
            median = statistics.median(tps[r] for r in rows[start:i])
            out.update((r, median) for r in rows[start:i])
            start = i
    return out


def _python_counted_speeds(d: dict, rows: list[int]) -> dict[int, float]:
    """Learned speeds, a pod whose uncached share of its speed is under the pool's median
    slowed by that proportion (PoolState's `_uncached_speeds`, engines that count hits)."""
    ratio = {r: min(d["prefill_tps_uncached"][r] / d["prefill_tps"][r], 1.0)
             if d["prefill_tps"][r] > 0 and d["prefill_tps_uncached"][r] > 0 else 1.0
             for r in rows}
    learned = [r for r in rows if d["prefill_tps"][r] > 0]
    ref = max(statistics.median(ratio[r] for r in learned), 0.05) if learned else 1.0
    return {r: d["prefill_tps"][r] * min(ratio[r] / ref, 1.0) for r in rows}


def _python_score(d: dict, req: SchedulingRequest, now: float) -> tuple[int, list[float]]:
    cands = [
        r for r in range(d["n"])
        if d["valid"][r] and d["ready"][r] and not d["draining"][r] and d["metrics_ok"][r]
        and d["scraped_at"][r] >= now - d["stale"]
    ]
    hashes = req.prefix_hashes.tolist()
    matched = []
    for r in cands:
        s, k = d["sets"][r], 0
        while k < len(hashes) and hashes[k] in s:
            k += 1
        matched.append(k)
    hit = any(matched)
    # the prompt outgrows its holders: its copy keeps the counted speed (predictedLatency)
    outgrows = hit and (d["demand"].share(hashes[0], now) * len(cands)
                        > sum(1 for m in matched if m))
    frac = [m / len(hashes) for m in matched] if hashes else [0.0] * len(cands)
    valid_rows = [r for r in range(d["n"]) if d["valid"][r]]
    ref_tps = _median_pos([d["prefill_tps"][r] for r in valid_rows], 1000.0)
    ref_step = _median_pos([d["decode_step_s"][r] for r in valid_rows], 0.03)
    ref_pace = _median_pos([d["pace"][r] for r in valid_rows], 0.0)
    counted = _python_counted_speeds(d, valid_rows)
    fresh_ratio = min(_median_pos([d["prefill_tps_uncached"][r] / d["prefill_tps"][r]
                                   for r in valid_rows if d["prefill_tps"][r] > 0], 1.0), 1.0)
    tps_of = _python_speed_classes({
        r: counted[r] if d["prefill_tps"][r] > 0 else ref_tps / _slow(d, r, ref_pace)
        for r in valid_rows
    })
    step_of = {r: d["decode_step_s"][r] if d["decode_step_s"][r] > 0
               else ref_step * _slow(d, r, ref_pace) for r in valid_rows}
    # an untried idle pod is probed at the fastest known speeds (PoolState.probe_speeds;
    # no KV capacities here, so no twins), once enough of the pool is known
    known = {r for r in valid_rows if d["prefill_tps"][r] > 0 or d["pace"][r] > 0}
    probe = bool(known) and len(known) >= PROBE_AFTER_KNOWN * len(valid_rows)
    if probe:
        guess_tps = max(tps_of[k] for k in known)
        guess_step = min(step_of[k] for k in known)
    queue, running, kv, ttft = [], [], [], []
    cap = float(DEFAULT_BATCH_CAPACITY)
    for i, r in enumerate(cands):
        disp = d["dispatched"][r]
        q = d["waiting"][r] + disp
        queue.append(q)
        running.append(d["running"][r] + disp)
        kv.append(min(1.0, max(0.0, 1.0 - d["kv_usage"][r])))
        tps, step = tps_of[r], step_of[r]
        if probe and r not in known and d["inflight"][r] <= 0:
            tps, step = guess_tps, guess_step
        # no slower than the pod's own uncached speed (PoolState.fresh_speeds)
        fresh = max(tps * fresh_ratio,
                    min(tps, d["prefill_tps_uncached"][r]) if d["prefill_tps"][r] > 0 else 0.0)
        since = d["since"][r] if disp > 0 else 0.0
        ahead = max(d["waiting"][r] * d["mean_prompt"] / tps, d["backlog"][r] / fresh)
        own = req.prompt_tokens * (1 - frac[i]) / (tps if outgrows else fresh)
        slots = max(0.0, d["running"][r] + q + 1.0 - cap)
        ttft.append(ahead + since / fresh + own + step + slots * step * d["mean_output"] / cap)
    best = min(ttft)
    latency = [best / x for x in ttft]
    near = [1.0 if x >= 1.0 / (1.0 + NEAR_BEST) else 0.0 for x in latency]
    lru = [0.0] * len(cands) if hit else _minmax_inv([d["last_picked_at"][r] for r in cands])
    scores = {
        "predictedLatency": latency,
        "prefix": [f * (x >= 1.0 / PREFIX_TTFT_RATIO) for f, x in zip(frac, latency, strict=True)]
        if hit else [0.0] * len(cands),
        "queue": [s * g for s, g in zip(_minmax_inv(queue), near, strict=True)],
        "kvCache": kv,
        "loraAffinity": [1.0] * len(cands),
        "runningRequests": [s * g for s, g in zip(_minmax_inv(running), near, strict=True)],
        "lru": [s * g for s, g in zip(lru, near, strict=True)],
    }
    totals = [sum(w * scores[name][i] for name, w in d["weights"].items())
              for i in range(len(cands))]
    top = max(range(len(cands)), key=totals.__getitem__)
    return cands[top], totals


# -- timing ------------------------------------------------------------------------------


def best_per_call(fn, calls: int, repeats: int) -> float:
    """Best-of-`repeats` mean seconds per call (the least disturbed run)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def prefix_memory(blocks_per_pod: int = 31_250, pods: int = 4) -> float:
    """Measured bytes per (pod, block) entry of a full PrefixIndex."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(blocks_per_pod)
    rng = np.random.default_rng(3)
    for row in range(pods):
        index.insert(row, rng.integers(1, 2**63, blocks_per_pod).tolist())
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(index)


def _timed_pick(built: tuple[Pool, Scheduler, SchedulingRequest, float], calls: int,
                quick: bool) -> float:
    """Best-of-repeats seconds per `pick` on a `build_pool` variant."""
    _, sched, req, now = built
    return best_per_call(partial(sched.pick, req, now), calls, 4 if quick else 9)


def run(quick: bool = False) -> str:
    rows = []
    for n in SIZES:
        pool, sched, req, now = build_pool(n)
        pick = sched.pick(req, now)
        inputs = _python_inputs(pool, sched)
        py_row, py_totals = _python_score(inputs, req, now)
        explain = sched.explain(req, now)
        ours_totals = {p["row"]: p["total"] for p in explain["pods"] if not p["filtered_reason"]}
        same_scores = all(
            math.isclose(ours_totals[r], v, rel_tol=1e-9, abs_tol=1e-9)
            for r, v in zip(sorted(ours_totals), py_totals, strict=True)
        )
        same_pick = pick.rows[0] == py_row or math.isclose(pick.scores[0], max(py_totals))
        # from the index (the prefix score is 0 where the pod is predicted past 4x the best)
        blocks = sched.state.prefix.match(req.prefix_hashes.tolist(), pool.table.capacity)
        matched = 0 if blocks is None else int(blocks[n // 2])
        calls = max(20, int(20_000 / math.sqrt(n))) // (4 if quick else 1)
        ours = _timed_pick((pool, sched, req, now), calls, quick)
        py_calls = max(2, int(2_000 / n) // (2 if quick else 1))
        python = best_per_call(partial(_python_score, inputs, req, now), py_calls, 3)
        variants = [_timed_pick(build_pool(n, adapters=ADAPTERS), calls, quick),
                    _timed_pick(build_pool(n, prefill_clock=False), calls, quick)]
        rows.append((n, ours, python, same_pick and same_scores, matched, *variants))
        print(f"{n:>6} pods: {ours * 1e6:8.1f} µs vs {python * 1e6:10.1f} µs python "
              f"({python / ours:5.1f}×) same={same_pick and same_scores}; adapter "
              f"{variants[0] * 1e6:.1f} µs, no prefill clock {variants[1] * 1e6:.1f} µs",
              file=sys.stderr)
    per_entry = prefix_memory(8_000 if quick else 31_250)
    lines = [
        "# Scoring benchmark (`python -m bench.bench_scoring`)",
        "",
        "Full `llm-d` profile (filters; predictedLatency, prefix, queue, kvCache, loraAffinity,",
        "runningRequests, lru; weighted sum; pick + 2 fallbacks) for a 2,048-token prompt",
        f"({PROMPT_BLOCKS} blocks) continuing a conversation one pod served, over a prefix index",
        "filled by simulated traffic (32 shared system prompts, up to 20,000 past requests).",
        "Best-of-repeats per pick on this machine; pure Python = same scores with per-pod loops.",
        f"Beside it, the same pick for a LoRA adapter's request ({ADAPTERS} adapters on"
        f" {ADAPTER_SLOTS} slots per pod:",
        "the `lora` and `lora-home` filters and the adapter terms run) and on pages without a",
        "prefill clock (SGLang: the prefill-due floor runs), each as a ratio to the first column.",
        "",
        "| pods | vectorized (µs/pick) | pure Python (µs/pick) | speed-up | same pick & scores |"
        " conversation pod's match | adapter request | no prefill clock |",
        "| ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: |",
    ]
    for n, ours, python, same, matched, adapter, blind in rows:
        lines.append(
            f"| {n:,} | {ours * 1e6:.1f} | {python * 1e6:,.0f} | {python / ours:.0f}× | "
            f"{'yes' if same else 'NO'} | {matched}/{PROMPT_BLOCKS} blocks | "
            f"{adapter * 1e6:.1f} ({adapter / ours:.2f}×) | "
            f"{blind * 1e6:.1f} ({blind / ours:.2f}×) |"
        )
    lines += [
        "",
        f"Prefix index memory: {per_entry:.0f} bytes per (pod, block) entry measured with",
        f"tracemalloc, i.e. {per_entry * 31_250 / 2**20:.1f} MiB per pod at the default 31,250"
        " blocks per pod.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    args = parser.parse_args()
    table = run(args.quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
