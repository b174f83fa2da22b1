"""Screen a routing change on the family members it can move, against a baseline.

    python -m bench.screen --seed 0 --engine trtllm          # members with a TensorRT-LLM pool
    python -m bench.screen --seed 1 --adapters --base DIR/family.json
    python -m bench.screen --seed 0 --members 27,92

Each chosen member runs through the twin on the baseline row's twin seeds (its figure their
median, as `igw bench --family` reports it), with the baseline's yardsticks (they depend on the
plan only). Printed per member: p95 over best-ttft and over round-robin, old -> new; then the
geometric mean of new over old p95 over the chosen members. Why: a change to one engine's
signals or to adapter handling can move only the members that have them; screening those on
seed 0 and on held-out seeds takes a minute where the whole family takes five, with the same
arithmetic every time (docs/benchmarks.md judges changes so). A screen is not the verdict: a
change that passes it is run on the whole family (`igw bench --family 100 --twin-only`).

The baseline is a family.json of the code without the change: the committed
bench/results/family.json for seed 0, or `igw bench --family 60 --seed 1 --out DIR` run from a
checkout without it (then `--base DIR/family.json`). A member whose plan changed since (another
fingerprint) is skipped: its yardsticks would not match.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.family import fingerprint, member_indices, parallel_map, run_scenario, scenario

RESULTS = Path(__file__).resolve().parent / "results"
# A member whose p95 moved by more than this factor either way is named in the summary.
MOVED = 1.05


def select(rows: Sequence[dict[str, Any]], members: Sequence[int] | None = None,
           engine: str | None = None, adapters: bool = False) -> list[dict[str, Any]]:
    """The baseline rows to screen: those of `members` (every row when None) that have a
    pool on `engine` (when given) and a pool with adapters (when `adapters`)."""
    chosen = []
    for row in rows:
        params = row["params"]
        pools = params["pools"]
        if members is not None and params["index"] not in members:
            continue
        if engine is not None and not any(pool["engine"] == engine for pool in pools):
            continue
        if adapters and not any(pool["adapters"] for pool in pools):
            continue
        chosen.append(row)
    return chosen


def screen_row(old: dict[str, Any]) -> dict[str, Any] | None:
    """The member of baseline row `old` on this code: its row as `igw bench --family`
    writes it, on the same twin seeds with the same yardsticks; None where the plan changed."""
    params = old["params"]
    plan = scenario(params["seed"], params["index"])
    if fingerprint(plan) != old["fingerprint"]:
        return None
    # a row of one twin seed names none: the family's seed (`run_scenario`'s default)
    return run_scenario(plan, old["yardsticks"], old["gateway"].get("twin_seeds"))


def summary(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Geometric mean of new over old p95 over (old, new) row pairs, and the members that
    moved by more than `MOVED`, largest change first."""
    ratios = [(new["gateway"]["ttft_p95"] / old["gateway"]["ttft_p95"], old["name"])
              for old, new in pairs if old["gateway"]["ttft_p95"] and new["gateway"]["ttft_p95"]]
    if not ratios:
        return {"members": 0}
    geomean = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
    moved = sorted(((r, n) for r, n in ratios if max(r, 1 / r) > MOVED),
                   key=lambda item: -abs(math.log(item[0])))
    return {"members": len(ratios), "geomean": geomean, "moved": moved}


def _line(old: dict[str, Any], new: dict[str, Any]) -> str:
    o, n = old["ratios"], new["ratios"]
    return (f"{old['name']}: x best-ttft {o['vs_best_ttft']:.2f} -> {n['vs_best_ttft']:.2f}, "
            f"x round-robin {o['vs_round_robin']:.2f} -> {n['vs_round_robin']:.2f}, adapter "
            f"loads {old['gateway']['adapter_loads']} -> {new['gateway']['adapter_loads']}; "
            f"p95 {new['gateway'].get('p95_by_seed', new['gateway']['ttft_p95'])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.screen",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the family's seed")
    p.add_argument("--base", type=Path, default=None,
                   help="the baseline family.json (default bench/results/family.json)")
    p.add_argument("--members", type=member_indices, default=None,
                   help="member indices, comma-separated")
    p.add_argument("--engine", default=None, help="only members with a pool on this engine")
    p.add_argument("--adapters", action="store_true", help="only members with adapters")
    p.add_argument("--jobs", type=int, default=None, help="members at once (default: cores)")
    args = p.parse_args(argv)
    doc = orjson.loads((args.base or RESULTS / "family.json").read_bytes())
    if doc["seed"] != args.seed:
        print(f"the baseline is the family of seed {doc['seed']}, not {args.seed}",
              file=sys.stderr)
        return 2
    rows = select(doc["scenarios"], args.members, args.engine, args.adapters)
    pairs = []
    for old, new in zip(rows, parallel_map(screen_row, rows, args.jobs), strict=True):
        if new is None:
            print(f"{old['name']}: plan changed since the baseline, skipped", flush=True)
            continue
        pairs.append((old, new))
        print(_line(old, new), flush=True)
    info = summary(pairs)
    if not info["members"]:
        print("no member screened")
        return 1
    moved = ", ".join(f"{name} x{ratio:.2f}" for ratio, name in info["moved"]) or "none"
    print(f"{info['members']} members: p95 new over old, geometric mean {info['geomean']:.4f}; "
          f"moved more than {MOVED}x: {moved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
