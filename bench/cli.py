"""`igw bench`: routing benchmarks on simulated fleets, and the per-request overhead benchmark.

    igw bench --scenario all                       # every scenario, every router (~20 min)
    igw bench --scenario mixed --routers igw-llm-d,envoy-rr --duration 20
    igw bench --smoke                              # seconds: tiny fleet, two routers
    igw bench --overhead                           # added latency and CPU per request
    igw bench --replicas 1,2,4 --no-coordination   # N gateways behind an L4 front
    igw bench --twin-replicas 1,2,4                # the same in the twin (virtual time)
    igw bench --family 100 --seed 0                # the gateway's twin on a scenario family
    igw bench --family 4 --live                    # the family's sample live, then
    igw bench --family 4 --twin-check --out DIR    # the twin against it (DIR/family-live.json)
    igw bench --ext-proc-servers                   # grpc.aio vs grpclib vs ours behind Envoy
    igw bench --guidellm-check --guidellm PATH     # TTFT cross-check with guidellm
    igw bench --global-cost --duration 30          # the global router's cost vs fastest
    igw bench --global-overhead                    # what the global tier adds per request

Results: bench/results/REPORT.md (+ <scenario>.json, PNG plots) for a full run;
a partial run writes to bench/results/partial/ unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.output import utc_stamp
from bench.routers import DEFAULT_ROUTERS, ROUTERS, parse_routers, versions
from bench.scenarios import ALL, SCENARIOS, Plan, Scenario

RESULTS = Path(__file__).resolve().parent / "results"

# Published results of this kind of gateway vs Kubernetes round-robin (the rows):
# (row, pool model or None for the whole scenario, Δ TTFT p95 %, Δ p99 %, Δ throughput %);
# None = "comparable".
PUBLISHED: dict[str, list[tuple[str, str | None, float | None, float | None, float | None]]] = {
    "mixed": [("Llama-3.1-8B", "llama-3.1-8b", -97, -97, 8),
              ("Qwen3-32B", "qwen3-32b", -98, -97, 50)],
    "bursty": [("Llama-3.1-70B", None, -94, -98, 12), ("Qwen3-235B", None, None, -89, None)],
    "prefix": [("Llama-3.1-8B", None, -26, -43, None)],
    "uniform": [("Qwen3-235B", None, None, None, None)],
}
COMPARABLE_PCT = 10.0


def _command(argv: list[str] | None) -> str:
    """The command line as results files record it."""
    return "igw bench " + " ".join(argv if argv is not None else sys.argv[1:])


def _members(text: str) -> list[int]:
    """`--members`, parsed by bench.family (imported only when given: it costs every
    `igw bench` start a fifth of a second)."""
    from bench.family import member_indices

    return member_indices(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="igw bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="all",
                   help=f"all or a comma list of: {', '.join([*ALL, 'tiny'])}")
    p.add_argument("--routers", default=None,
                   help=f"comma list (default: {','.join(DEFAULT_ROUTERS)}); known: "
                        f"{','.join(ROUTERS)}")
    p.add_argument("--duration", type=float, default=None,
                   help="wall seconds of arrivals per router run (default: per scenario)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="override every scenario's simulator time_scale; without --duration "
                        "the arrivals stay the same (the same model seconds, in more or "
                        "less wall time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="tiny scenario, gateway llm-d + Envoy round robin, a few seconds each")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch directory for configs and logs (default: a temp dir)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--overhead", action="store_true",
                   help="run the overhead benchmark (bench/overhead.py) instead")
    p.add_argument("--ext-proc-servers", action="store_true",
                   help="compare do-nothing ext_proc servers behind Envoy "
                        "(bench/ext_proc_servers.py) instead")
    p.add_argument("--guidellm-check", action="store_true",
                   help="cross-check our TTFT against guidellm (bench/guidellm_check.py)")
    p.add_argument("--global-cost", action="store_true",
                   help="cheapest-within-slo vs fastest vs an Envoy priority front on the "
                        "`igw global up` demo (bench/global_cost.py); --duration per level "
                        "and front, --seed; results to bench/results/global-cost.md")
    p.add_argument("--global-overhead", action="store_true",
                   help="what the global tier adds per request against Tier 1's own, closed "
                        "loop and at equal offered rates (bench/global_overhead.py); "
                        "--duration per point and path; results to "
                        "bench/results/global_overhead.md")
    p.add_argument("--guidellm", default=None, help="guidellm executable for --guidellm-check")
    p.add_argument("--replay", action="store_true",
                   help="print the perfect-information replay (bench/replay.py) of --scenario "
                        "at --seed without starting any process")
    p.add_argument("--replicas", default=None, metavar="N[,N...]",
                   help="igw-llm-d as N replicas behind an L4 tcp_proxy front "
                        "(bench/replicas.py), coordinated through a redis-server; results "
                        "merged into bench/results/replicas.md (+ .json)")
    p.add_argument("--no-coordination", action="store_true",
                   help="with --replicas: the replicas do not coordinate")
    p.add_argument("--compare-coordination", action="store_true",
                   help="with --replicas: run both, coordinated and not, alternated")
    p.add_argument("--repeats", type=int, default=None,
                   help="with --replicas: alternated repeats of every configuration (default "
                        "1); with --twin-replicas: the twin's seeds 0..R-1 (default 1); with "
                        "--family: the twin's seeds S..S+R-1 per member, figures their median "
                        "(default 3)")
    p.add_argument("--scrape-load", type=float, default=None, metavar="SECONDS",
                   help="with --replicas: measure the pods' scrape load at each N instead, "
                        "uncoordinated then coordinated sharing scrape results "
                        "(--no-coordination: uncoordinated only)")
    p.add_argument("--family", type=int, default=None, metavar="N",
                   help="the gateway's twin (bench/twin.py) against the replay's yardsticks on "
                        "N scenarios of the seeded family (bench/family.py) of --seed; results "
                        "to bench/results/family.md (+ .json). With --replicas or "
                        "--twin-replicas: instead of --scenario, a sample of N members a live "
                        "run can afford, spread over the family's kinds (family.sample)")
    p.add_argument("--members", type=_members, default=None, metavar="I[,I...]",
                   help="with --family's sample and --replicas or --twin-replicas: only the "
                        "sample's members of these family indices")
    p.add_argument("--twin-replicas", default=None, metavar="N[,N...]",
                   help="the gateway's twin as N replicas behind the L4 front, not coordinated "
                        "and coordinated (bench/replicas_twin.py), on --scenario's plans as "
                        "--replicas sends them (or --family's sample); virtual time, minutes; "
                        "merged into bench/results/replicas-twin.md (+ .json)")
    p.add_argument("--share-scrapes", action="store_true",
                   help="with --twin-replicas: also coordinated replicas sharing scrape results")
    p.add_argument("--jobs", type=int, default=None,
                   help="with --family: members run at once in worker processes (default: "
                        "one per core)")
    p.add_argument("--twin-only", action="store_true",
                   help="with --family: reuse the yardsticks of the previous family.json for "
                        "unchanged plans, run only the twin")
    p.add_argument("--twin-check", action="store_true",
                   help="the twin on --scenario's plans (and with --family K on the family's "
                        "sample) against the live gateway's results in --out (default "
                        "bench/results)")
    p.add_argument("--live", action="store_true",
                   help="with --family K: the family's sample of K (family.sample) run live "
                        "through --routers (default igw-llm-d,envoy-rr), results to --out "
                        "(default bench/results/partial/family-live); --twin-check compares")
    p.add_argument("--rerender", action="store_true",
                   help="rebuild REPORT.md and plots from the <scenario>.json files in --out "
                        "(default bench/results) without running anything")
    return p


def _scenarios(text: str) -> list[str]:
    names = list(ALL) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(unknown)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.overhead:
        from bench.overhead import main as overhead_main

        return overhead_main(["--out", str(args.out)] if args.out else [])
    if args.ext_proc_servers:
        from bench.ext_proc_servers import main as servers_main

        out_args = ["--out", str(args.out)] if args.out else []
        return servers_main(out_args, command=" ".join(["igw bench --ext-proc-servers",
                                                        *out_args]))
    if args.guidellm_check:
        from bench.guidellm_check import main as check_main

        extra = ["--guidellm", args.guidellm] if args.guidellm else []
        return check_main((["--out", str(args.out)] if args.out else []) + extra)
    if args.global_cost:
        from bench.global_cost import main as cost_main

        extra = ["--duration", f"{args.duration:g}"] if args.duration else []
        extra += ["--seed", str(args.seed)] + (["--out", str(args.out)] if args.out else [])
        return cost_main(extra)
    if args.global_overhead:
        from bench.global_overhead import main as global_overhead_main

        extra = ["--duration", f"{args.duration:g}"] if args.duration else []
        return global_overhead_main(extra + (["--out", str(args.out)] if args.out else []))
    if args.rerender:
        return rerender(args.out or RESULTS)
    if args.replay:
        return print_replay(_scenarios(args.scenario), args.seed, args.duration, args.time_scale)
    if args.twin_replicas:
        return twin_replicas_main(args, argv)
    if args.replicas:
        return replicas_main(args, argv)
    if args.family is not None and args.live:
        return family_live_main(args, argv)
    if args.twin_check:
        from bench.twin import live_check

        results = args.out or RESULTS
        rows = live_check([] if args.family and args.scenario == "all"
                          else _scenarios(args.scenario), args.seed, results, args.family)
        if args.family:  # for the report's family section (bench.family.update_report)
            from bench.family import LIVE_SAMPLE

            command = _command(argv)
            ran = sorted({name for row in rows for name in row["live_p95"]})
            doc = {"date": utc_stamp(),
                   "command": command, "seed": args.seed, "routers": ran, "rows": rows}
            (results / LIVE_SAMPLE).write_text(json.dumps(doc, indent=1))
        return 0
    if args.family is not None:
        from bench.family import TWIN_SEEDS, run_family

        run_family(args.seed, args.family, args.out or RESULTS, args.twin_only,
                   args.repeats or TWIN_SEEDS, args.jobs)
        return 0
    if args.smoke:
        names = ["tiny"]
        routers = parse_routers(args.routers or "igw-llm-d,envoy-rr")
    else:
        names = _scenarios(args.scenario)
        routers = parse_routers(args.routers)
    full = not args.smoke and names == list(ALL) and args.routers in (None, "all")
    out = args.out or (RESULTS if full else RESULTS / ("smoke" if args.smoke else "partial"))
    if args.smoke and args.out is None:
        out = Path(tempfile.mkdtemp(prefix="igw-bench-smoke-"))
    with tempfile.TemporaryDirectory(prefix="igw-bench-") as tmp:
        work = args.work or Path(tmp)
        command = _command(argv)
        return asyncio.run(_run(_named(names, args), routers, args, out, work, full, command))


def _named(names: list[str], args: argparse.Namespace, *, comparison: bool = False
           ) -> list[tuple[Scenario, Plan, Plan]]:
    """(scenario, plan, warm-up plan) of each named scenario: the plan of --seed (its
    comparison span for `comparison`), the warm-up of seed + 1000 for 3 s wall (1 s for
    `tiny`)."""
    out = []
    for name in names:
        scenario = SCENARIOS[name]
        plan = scenario.plan(args.seed, args.duration, args.time_scale, comparison=comparison)
        warm = scenario.plan(args.seed + 1000, 3.0 if name != "tiny" else 1.0, args.time_scale)
        out.append((scenario, plan, warm))
    return out


async def _run(items: list[tuple[Scenario, Plan, Plan]], routers, args: argparse.Namespace,
               out: Path, work: Path, full: bool, command: str) -> int:
    from bench.report import write_scenario
    from bench.runner import run_scenario

    _use_uvloop()
    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": utc_stamp(),
        "command": command.strip(),
        "versions": versions(),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        "seed": args.seed,
        "routers": [r.name for r in routers],
    }
    sections: list[str] = []
    headline: list[dict[str, Any]] = []
    failed = 0
    for scenario, plan, warm in items:
        print(f"{scenario.name}: {len(plan.requests)} requests, {plan.wall_duration_s:.0f} s "
              f"wall per router, time_scale {plan.time_scale:g}, {len(routers)} routers",
              flush=True)
        runs = await run_scenario(plan, warm, routers, work / scenario.name, seed=args.seed,
                                  progress=not args.no_progress)
        failed += sum(1 for r in runs if not r.ok)
        section, item = write_scenario(out, scenario, plan, runs, meta)
        sections.append(section)
        headline.append(item)
    meta["total_wall_s"] = round(time.monotonic() - started, 1)
    report = render_report(meta, sections, headline, full)
    out.mkdir(parents=True, exist_ok=True)
    (out / "REPORT.md").write_text(report)
    from bench.family import update_report

    update_report(out)  # a family run's section (bench/family.py) is kept at the end
    print(f"report: {out / 'REPORT.md'} ({meta['total_wall_s']:.0f} s)", flush=True)
    return 1 if failed else 0


def family_live_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`--family K --live`: the family's sample of K, each member with its own warm-up, live
    through --routers; <member>.json and REPORT.md in --out, for `--twin-check --family K`."""
    from bench.family import live_run, sample

    routers = parse_routers(args.routers or "igw-llm-d,envoy-rr")
    out = args.out or RESULTS / "partial" / "family-live"
    items = [live_run(member) for member in sample(args.seed, args.family)]
    command = _command(argv)
    with tempfile.TemporaryDirectory(prefix="igw-bench-") as tmp:
        return asyncio.run(_run(items, routers, args, out, args.work or Path(tmp), False,
                                command))


def replicas_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`--replicas`: the scenarios at each N (or the scrape load), merged into
    replicas.json / replicas.md (in --out when given, else bench/results)."""
    from bench.replicas import render_markdown, replica_specs, scrape_load, update_results
    from bench.runner import tls_material

    counts = [int(n) for n in args.replicas.split(",")]
    coordination = [False, True] if args.compare_coordination else [not args.no_coordination]
    results = args.out or RESULTS
    table = results / "replicas.json"
    results.mkdir(parents=True, exist_ok=True)
    command = _command(argv)
    with tempfile.TemporaryDirectory(prefix="igw-bench-") as tmp:
        work = args.work or Path(tmp)
        if args.scrape_load:
            pods = SCENARIOS[args.scenario if args.scenario != "all" else "mixed"].plan(0).pods
            # uncoordinated (every replica scrapes every pod), then sharing scrape results
            modes = (False,) if args.no_coordination else (False, True)
            load = scrape_load(work, pods, counts, args.scrape_load, tls_material(work), modes)
            doc = json.loads(table.read_text()) if table.exists() else {}
            doc["scrape_load"] = {**load, "command": command}
            table.write_text(json.dumps(doc, indent=1))
            failed = 0
        else:
            if args.family is not None:  # a family sample, each member's arrivals at every N
                from bench.family import live_run, sample_of

                items = [live_run(member)
                         for member in sample_of(args.seed, args.family, args.members)]
            else:
                items = _named(["tiny"] if args.smoke else _scenarios(args.scenario), args,
                               comparison=True)
            names = [scenario.name for scenario, _, _ in items]
            routers = replica_specs(counts, coordination, args.repeats or 1)
            out = results / "partial" / "replicas"
            failed = asyncio.run(_run(items, routers, args, out, work, False, command))
            meta = {"date": utc_stamp(),
                    "command": command}
            doc = update_results([out], names, table, meta)
            if args.family is not None:
                doc.setdefault("family", {}).update(
                    {scenario.name: scenario.description for scenario, _, _ in items})
                table.write_text(json.dumps(doc, indent=1))
    (results / "replicas.md").write_text(render_markdown(doc))
    print(f"replicas: {results / 'replicas.md'}", flush=True)
    return failed


def twin_replicas_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """`--twin-replicas`: the twin as N replicas on --scenario's plans, or --family's sample
    of --seed, merged into replicas-twin.json / .md (in --out when given, else bench/results)."""
    from bench.replicas_twin import MODES, run

    counts = [int(n) for n in args.twin_replicas.split(",")]
    modes = ["nocoord"] if args.no_coordination else [
        m for m in MODES if m != "shared" or args.share_scrapes]
    names = [] if args.family is not None else _scenarios(args.scenario)
    family = (args.seed, args.family) if args.family is not None else None
    command = _command(argv)
    run(names, family, counts, modes, args.repeats or 1, args.seed, args.out or RESULTS, command,
        args.duration, args.time_scale, args.members)
    return 0


def print_replay(names: list[str], seed: int, duration: float | None,
                 time_scale: float | None) -> int:
    """One line per scenario (and pool): TTFT p95 / p99 of each replay policy, and best-ttft's
    change against strict round-robin: what routing alone can win in that plan."""
    from bench.replay import replay_reference
    from bench.report import change

    def signed(key: str, figs: dict[str, Any]) -> str:
        delta = change(figs["best-ttft"][key], figs["round-robin"][key])
        return "n/a" if delta is None else f"{delta:+.0f}%"

    for name in names:
        plan = SCENARIOS[name].plan(seed, duration, time_scale)
        ref = replay_reference(plan)
        rows = [(name, ref)]
        if "per_pool" in ref["round-robin"]:
            rows += [(f"{name} {pool}", {k: v["per_pool"][pool] for k, v in ref.items()})
                     for pool in ref["round-robin"]["per_pool"]]
        for label, figs in rows:
            cells = "  ".join(f"{k} {v['ttft_p95']:.3f}/{v['ttft_p99']:.3f}s"
                              for k, v in figs.items())
            print(f"{label} (seed {seed}, {len(plan.requests)} requests): {cells}  best-ttft vs "
                  f"round-robin p95 {signed('ttft_p95', figs)} p99 {signed('ttft_p99', figs)}",
                  flush=True)
    return 0


def rerender(out: Path) -> int:
    """REPORT.md and plots again from the raw JSON of a previous run (same seed and scale)."""
    from bench.report import load_runs, write_scenario

    sections, headline = [], []
    meta: dict[str, Any] = {}
    for name in [*ALL, "tiny"]:
        path = out / f"{name}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        meta = doc.get("meta", meta)
        scenario = SCENARIOS[name]
        scale = doc["time_scale"]
        plan = scenario.plan(meta.get("seed", 0), doc["duration_model_s"] / scale, scale)
        runs = load_runs(doc)
        section, item = write_scenario(out, scenario, plan, runs, meta)
        sections.append(section)
        headline.append(item)
    if not headline:
        print(f"no <scenario>.json in {out}", file=sys.stderr)
        return 1
    if "total_wall_s" not in meta:  # kept from the report being replaced, if any
        import re

        old = (out / "REPORT.md").read_text() if (out / "REPORT.md").exists() else ""
        found = re.search(r"Total wall time (\d+) s", old)
        meta["total_wall_s"] = float(found.group(1)) if found else 0.0
    (out / "REPORT.md").write_text(render_report(meta, sections, headline,
                                                 full=len(headline) >= len(ALL)))
    from bench.family import update_report

    update_report(out)
    print(f"report: {out / 'REPORT.md'} (re-rendered)")
    return 0


def _use_uvloop() -> None:
    """uvloop, when installed, makes the load generator cheaper per request."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _verdict(ours: float | None, published: float | None) -> str:
    if ours is None:
        return "n/a"
    if published is None:  # "comparable"
        return "meets" if ours <= COMPARABLE_PCT else "misses"
    return "meets" if ours <= published else "misses"


def _verdict_throughput(ours: float | None, published: float | None) -> str:
    if ours is None:
        return "n/a"
    if published is None:
        return "meets" if ours >= -COMPARABLE_PCT else "misses"
    return "meets" if ours >= published else "misses"


def headline_rows(headline: list[dict[str, Any]]) -> list[str]:
    from bench.report import best_peer, change, ideal_ttft

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:+.0f}%"

    def pub(v: float | None) -> str:
        return "comparable" if v is None else f"{v:+.0f}%"

    lines = [
        "| scenario (published row) | published Δ p95 / p99 / throughput | gateway llm-d vs "
        "Envoy RR: Δ p95 / p99 / tok/s | best peer vs Envoy RR: Δ p95 / p99 | gateway vs best "
        "peer: Δ p95 / p99 | best possible vs Envoy RR: Δ p95 / p99 | perfect-information "
        "replay: best-ttft vs round-robin Δ p95 / p99 | gateway vs best-ttft: Δ p95 / p99 "
        "| row met? |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for item in headline:
        sums = {s["router"]: s for s in item["summaries"] if s.get("ok")}
        ours, base = sums.get("igw-llm-d"), sums.get("envoy-rr")
        peer = best_peer(item["summaries"])
        ideal = ideal_ttft(item["plan"])
        replay = item.get("replay") or {}
        best, ideal_rr = replay.get("best-ttft"), replay.get("round-robin")
        rows = PUBLISHED.get(item["scenario"], [(item["scenario"], None, None, None, None)])
        for row, pool, p95, p99, thr in rows:
            def fig(s: dict[str, Any] | None, key: str, pool=pool) -> float | None:
                if s is None:
                    return None
                if pool is not None and "per_pool" in s:
                    return s["per_pool"][pool].get(key)
                return s.get(key)

            d95 = change(fig(ours, "ttft_p95"), fig(base, "ttft_p95"))
            d99 = change(fig(ours, "ttft_p99"), fig(base, "ttft_p99"))
            dtok = change(fig(ours, "output_tokens_per_s"), fig(base, "output_tokens_per_s"))
            q95 = change(fig(peer, "ttft_p95"), fig(base, "ttft_p95"))
            q99 = change(fig(peer, "ttft_p99"), fig(base, "ttft_p99"))
            v95 = change(fig(ours, "ttft_p95"), fig(peer, "ttft_p95"))
            v99 = change(fig(ours, "ttft_p99"), fig(peer, "ttft_p99"))
            b95 = change(fig(ideal, "ttft_p95"), fig(base, "ttft_p95"))
            b99 = change(fig(ideal, "ttft_p99"), fig(base, "ttft_p99"))
            r95 = change(fig(best, "ttft_p95"), fig(ideal_rr, "ttft_p95"))
            r99 = change(fig(best, "ttft_p99"), fig(ideal_rr, "ttft_p99"))
            g95 = change(fig(ours, "ttft_p95"), fig(best, "ttft_p95"))
            g99 = change(fig(ours, "ttft_p99"), fig(best, "ttft_p99"))
            published = item["scenario"] in PUBLISHED
            verdicts = [_verdict(d95, p95), _verdict(d99, p99), _verdict_throughput(dtok, thr)]
            met = ("yes" if all(v == "meets" for v in verdicts) else
                   "partly: " + ", ".join(f"{k} {v}" for k, v in
                                          zip(("p95", "p99", "tput"), verdicts, strict=True)))
            lines.append(
                f"| {item['scenario']} ({row}) | "
                f"{(pub(p95) + ' / ' + pub(p99) + ' / ' + pub(thr)) if published else 'no row'} "
                f"| {pct(d95)} / {pct(d99)} / {pct(dtok)} "
                f"| {peer['router'] if peer else 'n/a'}: {pct(q95)} / {pct(q99)} "
                f"| {pct(v95)} / {pct(v99)} | {pct(b95)} / {pct(b99)} "
                f"| {pct(r95)} / {pct(r99)} | {pct(g95)} / {pct(g99)} "
                f"| {met if published else 'n/a'} |"
            )
    return lines


def render_report(meta: dict[str, Any], sections: list[str], headline: list[dict[str, Any]],
                  full: bool) -> str:
    versions_line = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    parts = [
        "# Routing benchmark report" + ("" if full else " (partial run)"),
        "",
        f"Generated by `{meta['command']}` on {meta['date']}: {meta['cores']} cores shared "
        f"with other work (1-minute load average {meta['load_average_at_start']:.1f} at the "
        f"start), Python {meta['python']}; {versions_line}. Total wall time "
        f"{meta['total_wall_s']:.0f} s. Method, scenarios and caveats: docs/benchmarks.md.",
        "",
        "All latencies are model seconds of the simulated GPUs (wall time × the scenario's "
        "time_scale). Δ = change vs Envoy ROUND_ROBIN on the same fleet and the same "
        "arrivals (negative TTFT = better, positive throughput = better). `best peer` = the "
        "sglang-router / vllm-router policy with the lowest TTFT p95 in that scenario. `best "
        "possible` = every request alone on its pool's fastest pod with shared prompts cached "
        "(no router can beat it): it bounds the Δ any router can show against this baseline, "
        "but ignores queueing. `perfect-information replay` = the same requests through the "
        "same engine model in virtual time (bench/replay.py): `best-ttft` sends each request "
        "where its own first token comes soonest, knowing every pod's exact state; "
        "`round-robin` rotates strictly. Its Δ is what routing one request at a time can win "
        "in the scenario; `gateway vs best-ttft` is how far the live gateway is from it.",
        "",
        *headline_rows(headline),
        "",
        *sections,
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
