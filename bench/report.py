"""Turn runs into figures: per-router summaries, markdown tables, PNG plots, raw JSON.

Definitions (all latencies in model seconds, i.e. what clients of the simulated GPUs see):
- TTFT percentiles over every sent request that got a first token, plus requests cut at the
  time cap before their first token, counted at the time they had waited (a lower bound);
  requests refused by the router (HTTP errors) have no TTFT and are counted in `errors`.
- E2E p95 over requests that finished before the cut.
- Throughput over the arrival window (first to last scheduled arrival): requests whose last
  byte arrived in it, and output tokens that arrived in it, per second of it. The same
  window for every router, so a router that lets queues build up delivers fewer.
- `errors`: HTTP errors, connection errors, requests without a first token at the cut,
  arrivals dropped at the load generator's concurrency cap (never happened if 0).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.loadgen import Result
from bench.replay import replay_reference
from bench.routers import BASELINE
from bench.runner import RunResult
from bench.scenarios import Plan, Scenario

NOT_ERRORS = ("", "unfinished")
PEER_KINDS = ("sglang", "vllm")


def is_error(r: Result) -> bool:
    return r.error not in NOT_ERRORS


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _round(v: float | None, n: int = 4) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, n)


def ttft_stats(results: list[Result]) -> dict[str, float | None]:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    return {f"ttft_p{q}": _round(_pct(ttft, q)) for q in (50, 95, 99)}


BOOTSTRAP = 2000


def bootstrap_ci(values: list[float], q: float, seed: int = 0) -> tuple[float, float] | None:
    """90 % bootstrap interval of the q-th percentile: how much the figure could move with
    another draw of the same traffic (a few hundred requests per run make p99 noisy)."""
    if len(values) < 20:
        return None
    a = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    samples = rng.choice(a, size=(BOOTSTRAP, len(a)), replace=True)
    stats = np.percentile(samples, q, axis=1)
    return float(np.percentile(stats, 5)), float(np.percentile(stats, 95))


def ideal_ttft(plan: Plan) -> dict[str, Any]:
    """TTFT percentiles if every request ran alone on its pool's fastest pod, with any shared
    system prompt already cached: no router can do better, so `best possible Δ` vs a
    baseline bounds what any router could show in this scenario."""
    from simulator.profiles import build_profile

    profiles = {
        pool.model: [build_profile(p["gpu"], p["model"]) for p in pool.pods] for pool in plan.pools
    }
    per_pool: dict[str, list[float]] = {}
    for req in plan.requests:
        uncached = max(1, req.prompt_tokens - req.shared_prefix_tokens)
        best = min((pr.base_step_ms + pr.per_seq_ms) / 1000 + uncached / pr.prefill_tokens_per_s
                   for pr in profiles[req.pool])
        per_pool.setdefault(req.pool, []).append(best)
    every = [t for ts in per_pool.values() for t in ts]
    out: dict[str, Any] = {f"ttft_p{q}": _round(_pct(every, q)) for q in (50, 95, 99)}
    if len(per_pool) > 1:
        out["per_pool"] = {pool: {f"ttft_p{q}": _round(_pct(ts, q)) for q in (50, 95, 99)}
                           for pool, ts in per_pool.items()}
    return out


def summarize(run: RunResult, plan: Plan) -> dict[str, Any]:
    """One router's figures for one scenario."""
    if not run.ok:
        return {"router": run.router, "label": run.label, "ok": False, "error": run.error}
    res = run.results
    window = max((s.at for s in plan.requests), default=0.0) or plan.duration_s
    finished = [r for r in res if r.e2e_s is not None]
    in_window = [r for r in finished if r.done_at_s is not None and r.done_at_s <= window]
    errors = Counter(r.error for r in res if is_error(r))
    late = [r.lateness_ms for r in res if r.error != "dropped"]
    sim_late = [
        (p.get("lateness_ms") or {}).get("p99") for p in run.pods.values()
        if (p.get("lateness_ms") or {}).get("count")
    ]
    queries = sum(p.get("prefix_cache_queries", 0) for p in run.pods.values())
    hits = sum(p.get("prefix_cache_hits", 0) for p in run.pods.values())
    out: dict[str, Any] = {
        "router": run.router,
        "label": run.label,
        "ok": True,
        "requests": len(res),
        **ttft_stats(res),
        "ttft_p95_ci90": _ci([r.ttft_s for r in res if r.ttft_s is not None], 95),
        "ttft_p99_ci90": _ci([r.ttft_s for r in res if r.ttft_s is not None], 99),
        "e2e_p95": _round(_pct([r.e2e_s for r in finished], 95)),
        "requests_per_s": _round(len(in_window) / window, 3),
        "output_tokens_per_s": _round(sum(r.tokens_in_window for r in res) / window, 1),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        "unfinished_at_cut": sum(1 for r in res if r.error == "unfinished"),
        "pods": dict(sorted(Counter(r.pod or "?" for r in res).items())),
        "prefix_hit_rate": _round(hits / queries, 3) if queries else None,
        "preemptions": sum(p.get("num_preemptions", 0) for p in run.pods.values()),
        "lora_loads": sum(p.get("lora_loads", 0) for p in run.pods.values()),
        "loadgen_lateness_ms": {
            "p50": _round(_pct(late, 50), 2), "p99": _round(_pct(late, 99), 2),
            "max": _round(max(late) if late else None, 2),
        },
        "simulator_lateness_p99_ms_worst_pod": _round(max(sim_late) if sim_late else None, 2),
        "cpu_avg_core_share": run.cpu.get("avg_core_share", {}),
        "cpu_peak_core_share": run.cpu.get("peak_core_share", {}),
        "machine_busy_share": run.cpu.get("machine_busy_share"),
        "max_in_flight": run.max_in_flight,
        "wall_s": run.wall_s,
        "setup_s": run.setup_s,
        "attempts": run.attempts,
    }
    if len(plan.pools) > 1:
        pool_of = {r.index: r.pool for r in plan.requests}
        out["per_pool"] = {}
        for pool in plan.pools:
            mine = [r for r in res if pool_of.get(r.index) == pool.model]
            out["per_pool"][pool.model] = {
                **ttft_stats(mine), "requests": len(mine),
                "output_tokens_per_s": _round(sum(r.tokens_in_window for r in mine) / window, 1),
            }
    return out


def _ci(values: list[float], q: float) -> list[float] | None:
    ci = bootstrap_ci(values, q)
    return None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


def change(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return (value - base) / base * 100.0


def _fmt_pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.0f}%"


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _fmt_ci(ci: list[float] | None) -> str:
    if not ci:
        return ""
    lo, hi = ci
    if hi < 1:
        return f"({lo * 1000:.0f}–{hi * 1000:.0f})"
    return f"({lo:.2f}–{hi:.2f})"


def best_peer(summaries: list[dict[str, Any]], key: str = "ttft_p95") -> dict[str, Any] | None:
    """The sglang-router / vllm-router run with the lowest `key`."""
    peers = [s for s in summaries if s.get("ok") and s["router"].split("-")[0] in PEER_KINDS
             and s.get(key) is not None]
    return min(peers, key=lambda s: s[key]) if peers else None


def comparison(summaries: list[dict[str, Any]], ours: str = "igw-llm-d") -> dict[str, Any]:
    """Our figures vs the Envoy round-robin baseline and the best peer, in %."""
    by = {s["router"]: s for s in summaries if s.get("ok")}
    base, mine = by.get(BASELINE), by.get(ours)
    peer = best_peer(summaries)
    out: dict[str, Any] = {"ours": ours, "baseline": BASELINE,
                           "best_peer": peer["router"] if peer else None}
    if mine and base:
        out["vs_baseline"] = {
            k: _round(change(mine.get(k), base.get(k)), 1)
            for k in ("ttft_p50", "ttft_p95", "ttft_p99", "e2e_p95", "output_tokens_per_s",
                      "requests_per_s")
        }
    if mine and peer:
        out["vs_best_peer"] = {
            k: _round(change(mine.get(k), peer.get(k)), 1)
            for k in ("ttft_p50", "ttft_p95", "ttft_p99", "output_tokens_per_s")
        }
    return out


def scenario_table(summaries: list[dict[str, Any]]) -> str:
    base = next((s for s in summaries if s["router"] == BASELINE and s.get("ok")), None)
    lines = [
        "| router | TTFT p50 | TTFT p95 (90% CI) | TTFT p99 (90% CI) | E2E p95 | req/s "
        "| out tok/s | errors | Δ TTFT p95 | Δ TTFT p99 | Δ tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        if not s.get("ok"):
            lines.append(f"| {s['label']} | failed: {s.get('error', '')[:80]} "
                         "| | | | | | | | | |")
            continue
        d95 = change(s["ttft_p95"], base["ttft_p95"]) if base else None
        d99 = change(s["ttft_p99"], base["ttft_p99"]) if base else None
        dtok = change(s["output_tokens_per_s"], base["output_tokens_per_s"]) if base else None
        bold = "**" if s["router"] == "igw-llm-d" else ""
        lines.append(
            f"| {bold}{s['label']}{bold} | {_fmt_s(s['ttft_p50'])} "
            f"| {_fmt_s(s['ttft_p95'])} {_fmt_ci(s.get('ttft_p95_ci90'))} "
            f"| {_fmt_s(s['ttft_p99'])} {_fmt_ci(s.get('ttft_p99_ci90'))} "
            f"| {_fmt_s(s['e2e_p95'])} | {s['requests_per_s']:.2f} "
            f"| {s['output_tokens_per_s']:.0f} | {s['errors']} | {_fmt_pct(d95)} "
            f"| {_fmt_pct(d99)} | {_fmt_pct(dtok)} |"
        )
    return "\n".join(lines)


def pool_table(summaries: list[dict[str, Any]], plan: Plan) -> str:
    base = next((s for s in summaries if s["router"] == BASELINE and s.get("ok")), None)
    lines = ["| router | " + " | ".join(
        f"{p.model} TTFT p95 | p99" for p in plan.pools) + " |",
        "| --- |" + " ---: | ---: |" * len(plan.pools)]
    for s in summaries:
        if not s.get("ok") or "per_pool" not in s:
            continue
        cells = []
        for p in plan.pools:
            mine = s["per_pool"][p.model]
            ref = base["per_pool"][p.model] if base else {}
            for key in ("ttft_p95", "ttft_p99"):
                delta = _fmt_pct(change(mine[key], ref.get(key)))
                cells.append(f"{_fmt_s(mine[key])} ({delta})")
        lines.append(f"| {s['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def health_table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| router | CPU avg (peak), % of a core, per process | machine busy | loadgen send "
        "lateness p50 / p99 / max | simulator lateness p99 (worst pod) | max open requests "
        "| prefix hit rate | preemptions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summaries:
        if not s.get("ok"):
            continue
        cpu = ", ".join(
            f"{name} {100 * v:.0f} ({100 * s['cpu_peak_core_share'].get(name, 0):.0f})"
            for name, v in s["cpu_avg_core_share"].items()
            if name != "igw-supervisor" or v > 0.01
        )
        lat = s["loadgen_lateness_ms"]
        busy = s["machine_busy_share"]
        hit = s["prefix_hit_rate"]
        lines.append(
            f"| {s['label']} | {cpu} | {'n/a' if busy is None else f'{100 * busy:.0f}%'} "
            f"| {lat['p50']} / {lat['p99']} / {lat['max']} ms "
            f"| {s['simulator_lateness_p99_ms_worst_pod']} ms | {s['max_in_flight']} "
            f"| {'n/a' if hit is None else f'{100 * hit:.0f}%'} | {s['preemptions']} |"
        )
    return "\n".join(lines)


# ----- plots ----------------------------------------------------------------------------


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_ttft_cdf(runs: list[RunResult], title: str, path: Path) -> bool:
    plt = _plt()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        if not run.ok:
            continue
        ttft = np.sort([r.ttft_s for r in run.results if r.ttft_s is not None])
        if len(ttft) == 0:
            continue
        y = np.arange(1, len(ttft) + 1) / len(ttft)
        width = 2.5 if run.router in ("igw-llm-d", BASELINE) else 1.2
        ax.plot(ttft, y, label=run.label, linewidth=width)
    finish_cdf(plt, fig, ax, path, xlabel="time to first token (model seconds, log scale)",
               ylabel="fraction of requests", title=f"{title}: TTFT CDF", marks=(0.95, 0.99))
    return True


def finish_cdf(plt: Any, fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str, title: str,
               marks: tuple[float, ...]) -> None:
    """Label, grid (log x), mark the `marks` shares, and save a CDF plot (the report's look)."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    for mark in marks:
        ax.axhline(mark, color="grey", linestyle=":", linewidth=0.8)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_queues(runs: list[RunResult], title: str, path: Path, time_scale: float,
                routers: tuple[str, ...] = (BASELINE, "igw-llm-d")) -> bool:
    """Per pod over time: waiting requests (left) and running requests (right), a row per
    router; sampled from every pod's /admin/state during the run."""
    plt = _plt()
    chosen = [r for name in routers for r in runs if r.router == name and r.ok and r.queues]
    if plt is None or not chosen:
        return False
    fig, axes = plt.subplots(len(chosen), 2, figsize=(13, 3.3 * len(chosen)), sharex=True,
                             squeeze=False)
    limits = [1.0, 1.0]
    pods: list[str] = []
    for row, run in enumerate(chosen):
        pods = sorted(run.queues[0]["pods"])
        t = [s["t"] * time_scale for s in run.queues]
        for col, (index, what) in enumerate(((0, "waiting"), (1, "running"))):
            ax = axes[row, col]
            for pod in pods:
                values = [s["pods"].get(pod, [0, 0, 0])[index] for s in run.queues]
                limits[col] = max(limits[col], max(values, default=0))
                ax.plot(t, values, label=pod, linewidth=1.1)
            ax.set_title(f"{run.label}: {what} requests per pod", fontsize=10)
            ax.grid(True, alpha=0.3)
    for row in range(len(chosen)):
        for col in range(2):
            axes[row, col].set_ylim(0, limits[col] * 1.05)
    axes[0, 1].legend(fontsize=7, ncol=2, loc="upper right")
    for col in range(2):
        axes[-1, col].set_xlabel("model seconds since the first arrival")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ----- files ----------------------------------------------------------------------------


def raw_json(scenario: Scenario, plan: Plan, runs: list[RunResult],
             summaries: list[dict[str, Any]], meta: dict[str, Any],
             replay: dict[str, Any]) -> bytes:
    """Everything measured, per request in columns (compact)."""
    fields = ("index", "model", "group", "scheduled_s", "lateness_ms", "status", "error",
              "ttft_s", "e2e_s", "output_tokens", "prompt_tokens", "pod", "done_at_s",
              "tokens_in_window")
    doc = {
        "scenario": scenario.name,
        "title": scenario.title,
        "rows": list(scenario.rows),
        "description": scenario.description,
        "time_scale": plan.time_scale,
        "duration_model_s": plan.duration_s,
        "requests": len(plan.requests),
        "calibration": plan.calibration,
        "meta": meta,
        "summaries": summaries,
        "ideal_ttft": ideal_ttft(plan),
        "replay": replay,
        "comparison": comparison(summaries),
        "runs": [
            {
                "router": r.router, "label": r.label, "ok": r.ok, "error": r.error,
                "describe": r.describe, "wall_s": r.wall_s, "arrivals_wall_s": r.arrivals_wall_s,
                "max_in_flight": r.max_in_flight, "setup_s": r.setup_s,
                "cpu": r.cpu, "cpu_timeline": r.cpu_timeline, "queues": r.queues,
                "pods": r.pods, "diagnostics": r.diagnostics, "attempts": r.attempts,
                "results": {f: [getattr(x, f) for x in r.results] for f in fields},
            }
            for r in runs
        ],
    }
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def scenario_section(scenario: Scenario, plan: Plan, summaries: list[dict[str, Any]],
                     plots: dict[str, str], replay: dict[str, Any]) -> str:
    cal = plan.calibration
    parts = [f"## {scenario.name}: {scenario.title}", ""]
    if scenario.rows:
        parts.append("Models the published row(s): " + "; ".join(scenario.rows) + ".")
        parts.append("")
    parts.append(scenario.description)
    parts.append("")
    pools = cal.get("pools", {})
    for model, info in pools.items():
        parts.append(
            f"- `{model}`: pods {', '.join(info['pods'])}; capacity per pod "
            f"{', '.join(str(c) for c in info['pod_capacity_rps'])} req/s; round-robin capacity "
            f"{info['rr_capacity_rps']} req/s; mean load {info['mean_rate_rps']} req/s "
            f"({100 * info['share_of_total_capacity']:.0f}% of the pool's total capacity)."
        )
    extra = {k: v for k, v in cal.items() if k not in ("pools",)}
    if extra:
        parts.append("- " + "; ".join(f"{k}: {v}" for k, v in extra.items()) + ".")
    parts.append(
        f"- {len(plan.requests)} requests over {plan.duration_s:.0f} model seconds "
        f"(time_scale {plan.time_scale:g}: {plan.wall_duration_s:.0f} s of wall time per router)."
    )
    ideal = ideal_ttft(plan)
    base = next((x for x in summaries if x["router"] == BASELINE and x.get("ok")), None)
    bound = ""
    if base:
        bound = (f"; best possible Δ vs Envoy round-robin: p95 "
                 f"{_fmt_pct(change(ideal['ttft_p95'], base['ttft_p95']))}, p99 "
                 f"{_fmt_pct(change(ideal['ttft_p99'], base['ttft_p99']))}")
    parts.append(
        f"- Lower bound (every request alone on its pool's fastest pod, shared prompts cached): "
        f"TTFT p50 {_fmt_s(ideal['ttft_p50'])}, p95 {_fmt_s(ideal['ttft_p95'])}, p99 "
        f"{_fmt_s(ideal['ttft_p99'])}{bound}."
    )
    parts.append(replay_line(replay, summaries))
    parts += ["", scenario_table(summaries), ""]
    if len(plan.pools) > 1:
        parts += ["Per pool (Δ vs Envoy round-robin):", "", pool_table(summaries, plan), ""]
    comp = comparison(summaries)
    if "vs_baseline" in comp:
        vb = comp["vs_baseline"]
        line = (f"**Gateway (llm-d) vs Envoy round-robin:** TTFT p95 {_fmt_pct(vb['ttft_p95'])}, "
                f"p99 {_fmt_pct(vb['ttft_p99'])}, output tokens/s "
                f"{_fmt_pct(vb['output_tokens_per_s'])}.")
        if "vs_best_peer" in comp:
            vp = comp["vs_best_peer"]
            line += (f" vs the best peer ({comp['best_peer']}): TTFT p95 "
                     f"{_fmt_pct(vp['ttft_p95'])}, p99 {_fmt_pct(vp['ttft_p99'])}.")
        parts += [line, ""]
    for name, rel in plots.items():
        parts += [f"![{scenario.name} {name}]({rel})", ""]
    parts += ["<details><summary>Run health (was anything but the router the bottleneck?)"
              "</summary>", "", health_table(summaries), "", "</details>", ""]
    return "\n".join(parts)


def replay_line(replay: dict[str, Any], summaries: list[dict[str, Any]]) -> str:
    """The perfect-information replay's figures and how far the live gateway is from them."""
    figs = "; ".join(
        f"{policy} {_fmt_s(r['ttft_p95'])} / {_fmt_s(r['ttft_p99'])}"
        for policy, r in replay.items()
    )
    ours = next((x for x in summaries if x["router"] == "igw-llm-d" and x.get("ok")), None)
    best = replay.get("best-ttft")
    gap = ""
    if ours and best:
        gap = (f"; live gateway llm-d vs best-ttft: p95 "
               f"{_fmt_pct(change(ours['ttft_p95'], best['ttft_p95']))}, p99 "
               f"{_fmt_pct(change(ours['ttft_p99'], best['ttft_p99']))}")
    line = (f"- Perfect-information replay (the same requests through the same engine model, "
            f"no clock, exact pod state; bench/replay.py), TTFT p95 / p99: {figs}{gap}.")
    pools = next((r["per_pool"] for r in replay.values() if "per_pool" in r), None)
    if pools and ours and "per_pool" in ours:
        for pool in pools:
            b, o = replay["best-ttft"]["per_pool"][pool], ours["per_pool"].get(pool)
            if o:
                line += (f" `{pool}`: best-ttft {_fmt_s(b['ttft_p95'])} / "
                         f"{_fmt_s(b['ttft_p99'])}, gateway vs it "
                         f"{_fmt_pct(change(o['ttft_p95'], b['ttft_p95']))} / "
                         f"{_fmt_pct(change(o['ttft_p99'], b['ttft_p99']))}.")
    return line


def write_scenario(out_dir: Path, scenario: Scenario, plan: Plan, runs: list[RunResult],
                   meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Write <name>.json and the plots; return the markdown section and the headline item
    (scenario, plan, summaries, perfect-information replay)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(r, plan) for r in runs]
    replay = replay_reference(plan)
    plots: dict[str, str] = {}
    cdf = out_dir / f"{scenario.name}-ttft-cdf.png"
    if plot_ttft_cdf(runs, scenario.title, cdf):
        plots["TTFT CDF"] = cdf.name
    queues = out_dir / f"{scenario.name}-queues.png"
    if plot_queues(runs, scenario.title, queues, plan.time_scale):
        plots["queues"] = queues.name
    (out_dir / f"{scenario.name}.json").write_bytes(
        raw_json(scenario, plan, runs, summaries, meta, replay))
    item = {"scenario": scenario.name, "plan": plan, "summaries": summaries, "replay": replay}
    return scenario_section(scenario, plan, summaries, plots, replay), item


def load_runs(doc: dict[str, Any]) -> list[RunResult]:
    """RunResults back from a <scenario>.json (to re-render a report without re-running)."""
    by_summary = {s["router"]: s for s in doc.get("summaries", [])}
    runs = []
    for r in doc["runs"]:
        summary = by_summary.get(r["router"], {})
        cols = r.get("results") or {}
        n = len(next(iter(cols.values()), []))
        results = [Result(**{k: cols[k][i] for k in cols}) for i in range(n)]
        runs.append(RunResult(
            router=r["router"], label=r.get("label") or summary.get("label", r["router"]),
            ok=r["ok"], error=r.get("error", ""), describe=r.get("describe", {}),
            results=results, cpu=r.get("cpu", {}), cpu_timeline=r.get("cpu_timeline", []),
            queues=r.get("queues", []), pods=r.get("pods", {}),
            wall_s=r.get("wall_s", summary.get("wall_s", 0.0)),
            arrivals_wall_s=r.get("arrivals_wall_s", 0.0),
            max_in_flight=r.get("max_in_flight", summary.get("max_in_flight", 0)),
            setup_s=r.get("setup_s", summary.get("setup_s", 0.0)),
            diagnostics=r.get("diagnostics", {}), attempts=r.get("attempts", 1),
        ))
    return runs
