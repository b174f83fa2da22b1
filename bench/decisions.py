"""Where the twin's routing loses, decision by decision, on one family member.

    python -m bench.decisions --seed 0 --member 74 [--twin-seed 0] [--tail 10]

At every dispatch of the gateway's twin (bench/twin.py) this records, before the pick:
- what the gateway would do, from `Scheduler.explain` (it changes no state): each pod's
  predicted TTFT and the filter that dropped it, if any;
- what each pod of the pool would really give: the request's first token there if it were
  sent now and nothing else arrived (`ReplayPod.first_token_in`, the pod forked and run
  forward; the same physics best-ttft routes on);

and after the run, where the request went and its TTFT. It prints the member's p95, the
regret of the decisions (the true first-token time on the chosen pod over the best pod's at
that moment) over all of them and over the requests in the p95 tail, and the tail's first
decisions pod by pod. Why: the family's aggregates say how far the gateway is from best-ttft,
not why; a rule is worth trying where the tail's decisions show what the gateway could have
known (docs/benchmarks.md, "Where the gap to best-ttft comes from").

A diagnostic for the bench, not part of the gateway. Observing does not change the twin's
decisions (tests/test_bench_decisions.py runs a member both ways).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.family import scenario
from bench.replay import measured_indices
from bench.twin import Twin, _Sent, _TwinPool
from simulator.server import build_request

# A decision costing more than this (model seconds) over the best pod counts as a miss.
MISS_S = 0.05


@dataclass
class Decision:
    """One dispatch: what the gateway saw and what each pod would have given."""

    position: int  # the request's place in the plan
    at: float  # model time of the dispatch
    held_s: float  # model seconds it waited in the gateway's queue first
    adapter: str | None
    prompt_tokens: int
    # pod -> seconds as the gateway predicts them: the engine's (model) seconds, the clock
    # its pages' histograms use; only a pool learned from the gateway's own pace (no speed on
    # the page) predicts in the gateway's seconds, model seconds / the plan's time scale
    predicted: dict[str, float] = field(default_factory=dict)
    filtered: dict[str, str] = field(default_factory=dict)  # pod -> the filter's reason
    truth: dict[str, float] = field(default_factory=dict)  # pod -> model seconds (inf: refused)
    chosen: str = ""
    ttft: float | None = None

    @property
    def regret(self) -> float:
        """The chosen pod's true first-token time over the best pod's, at dispatch."""
        best = min(self.truth.values())
        mine = self.truth.get(self.chosen, math.inf)
        return 0.0 if mine == best else mine - best


class DecisionLog:
    """The twin's observer: one `Decision` per dispatch, completed after the run."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self._sent: list[_Sent] = []

    def __call__(self, twin: Twin, tp: _TwinPool, sent: _Sent, t: float) -> None:
        scale = twin.scale
        report = tp.scheduler.explain(sent.request, t / scale)
        decision = Decision(sent.position, t, t - sent.arrival, sent.request.adapter,
                            sent.request.prompt_tokens)
        for pod in report["pods"]:
            name = _pod_name(twin, tp, pod["row"])
            if pod["filtered_reason"]:
                decision.filtered[name] = pod["filtered_reason"]
            elif "predicted_ttft_s" in pod:
                decision.predicted[name] = pod["predicted_ttft_s"]
        # first_token_in runs a copy of the probe, so one serves every pod
        probe, _ = build_request(sent.body, sent.spec_model, tp.base_model, True)
        for (pool, _row), pod in twin.by_row.items():
            if pool == tp.pool.name:
                decision.truth[pod.replay.spec.name] = pod.replay.first_token_in(probe, t)
        self.decisions.append(decision)
        self._sent.append(sent)

    def finish(self, ttft_s: list[float | None]) -> None:
        """Where each request went and its TTFT, once the twin has run; a request no pod
        could take (`NoCandidates`: observed, never dispatched) is dropped."""
        for decision, sent in zip(self.decisions, self._sent, strict=True):
            decision.chosen = sent.pod or ""
            decision.ttft = ttft_s[sent.position]
        self.decisions = [d for d in self.decisions if d.chosen]


def _pod_name(twin: Twin, tp: _TwinPool, row: int) -> str:
    return twin.by_row[(tp.pool.name, row)].replay.spec.name


def observe(seed: int, member: int, twin_seed: int = 0) -> tuple[list[Decision], list[float]]:
    """The member's decisions on one twin seed, and the measured requests' TTFTs."""
    plan = scenario(seed, member)
    log = DecisionLog()
    result = Twin(plan, seed=twin_seed, observe=log).run()
    log.finish(result.ttft_s)
    measured = set(measured_indices(plan))
    kept = [d for d in log.decisions if d.position in measured]
    ttfts = [t for i in sorted(measured) if (t := result.ttft_s[i]) is not None]
    return kept, ttfts


def summary(decisions: list[Decision], ttfts: list[float]) -> dict[str, Any]:
    """p95, and the regret over all decisions and over the p95 tail's."""
    p95 = float(np.percentile(ttfts, 95)) if ttfts else math.nan
    return {"requests": len(ttfts), "p95": p95, "all": _regret(decisions),
            "tail": _regret(tail_of(decisions, p95))}


def tail_of(decisions: list[Decision], p95: float) -> list[Decision]:
    """The decisions whose request's TTFT is at or above `p95`, in dispatch order."""
    return sorted((d for d in decisions if d.ttft is not None and d.ttft >= p95),
                  key=lambda d: d.at)


def _regret(decisions: list[Decision]) -> dict[str, float]:
    finite = [d for d in decisions if math.isfinite(d.regret)]
    if not finite:
        return {"decisions": 0}
    regret = np.array([d.regret for d in finite])
    held = np.array([d.held_s for d in finite])
    return {"decisions": len(finite), "mean_regret_s": float(regret.mean()),
            "p90_regret_s": float(np.percentile(regret, 90)),
            "missed_share": float((regret > MISS_S).mean()), "mean_held_s": float(held.mean())}


def _line(d: Decision) -> str:
    pods = sorted(d.truth)
    cells = ", ".join(
        f"{p.split('-', 1)[-1]}{'*' if p == d.chosen else ''} "
        f"true {_s(d.truth[p])} pred {_s(d.predicted.get(p))}"
        f"{' ' + d.filtered[p] if p in d.filtered else ''}" for p in pods)
    return (f"t={d.at:.2f} held {d.held_s:.2f} {d.adapter or '-'} prompt {d.prompt_tokens} "
            f"ttft {_s(d.ttft)} regret {_s(d.regret)}: {cells}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decisions", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the family's seed")
    p.add_argument("--member", type=int, required=True, help="the member's index")
    p.add_argument("--twin-seed", type=int, default=0)
    p.add_argument("--tail", type=int, default=10, help="tail decisions to print")
    args = p.parse_args(argv)
    decisions, ttfts = observe(args.seed, args.member, args.twin_seed)
    info = summary(decisions, ttfts)
    print(f"family-{args.seed}-{args.member} twin seed {args.twin_seed}: "
          f"{info['requests']} requests, TTFT p95 {info['p95']:.3f} s")
    for label in ("all", "tail"):
        r = info[label]
        if r["decisions"]:
            print(f"{label}: {r['decisions']} decisions, regret mean {r['mean_regret_s']:.3f} s, "
                  f"p90 {r['p90_regret_s']:.3f} s, over {MISS_S * 1000:.0f} ms in "
                  f"{r['missed_share']:.0%}; held in the gateway's queue {r['mean_held_s']:.3f} s")
    for d in tail_of(decisions, info["p95"])[:args.tail]:
        print(_line(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
