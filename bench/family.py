"""A seeded family of scenarios: many fleets and traffic shapes, not just our own five.

The five hand-written scenarios (bench/scenarios.py) each model one published row; a routing
change tuned on them can still lose elsewhere. `scenario(seed, index)` draws one scenario's
parameters from its own random stream (so scenario 7 of seed 3 is the same whether the family
has 10 or 100 members, and can be rebuilt alone from its recorded seed and index) and builds a
`Plan` from them with the same building blocks as the five (pods, capacity calibration, chat
bodies, log-normal lengths):

- fleet: 2-16 pods in one pool, or two pools of different models; 1-3 GPU types per pool
  (h200, h100, a100, l40s, a10g, l4) and models from 3B to 70B;
- engine per pool (vllm, sglang, trtllm) and, for a third of the vLLM and SGLang pools, an
  older version's page (`metrics_version`: the signal subset that version exports,
  simulator/metrics_text.py);
- load: 30-95 % of the pool's round-robin capacity (bench/capacity.py), as in the five;
  LoRA pools whose adapters outnumber their slots get 0.6x of that (slot pinning costs
  capacity the calibration does not see: `lora` collapsed under round-robin at 75 %);
- arrivals: Poisson, on/off bursts, a linear ramp, or a diurnal (sinusoidal) swing, all with
  the drawn mean rate;
- lengths: log-normal prompt (median 100-1,500 tokens, sigma 0.4-1.2: long tails) and output
  (median 30-300, sigma 0.3-1.0), clipped;
- shared prefixes (half the scenarios): 1-8 system prompts of 300-3,000 tokens on 50-100 % of
  the requests, Zipf popularity s 0-1.5;
- LoRA (40 % of the pools): 1-32 adapters, 1-4 slots per pod, Zipf popularity s 0-1.5, an
  adapter load cost of 0.5-4x the profile's (`lora_load_ms`).

Each plan carries a warm-up (its own traffic from another stream, outputs capped at 16
tokens, as bench/runner.py warms every live router) ahead of the measured requests: the
gateway has learned the pods' speeds and caches hold prompts, as when deployed. Every
reference policy of the replay runs the same warm-up. Family plans run at time_scale 1
(model seconds are wall seconds: the gateway's clocks as deployed on real GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson

from bench.capacity import Workload, round_robin_capacity
from bench.replay import WARMUP_GROUP, measured_indices, replay_reference
from bench.scenarios import (
    Plan,
    PoolPlan,
    Scenario,
    calibration,
    capacities,
    chat_request,
    make_pods,
)
from bench.workload import Corpus, RequestSpec, lognormal, lognormal_mean, on_off_arrivals

GPUS = ("h200", "h100", "a100", "l40s", "a10g", "l4")
MODELS = ("llama-3.2-3b", "llama-3.1-8b", "qwen3-14b", "qwen3-32b", "llama-3.1-70b")
ENGINES = (("vllm", 0.6), ("sglang", 0.2), ("trtllm", 0.2))
# Older pages with a smaller signal subset; Triton's 2025-02 backend is left out: its page has no
# waiting count, so the gateway refuses it (tests/test_simulator_dialects.py) and routes nothing.
OLD_VERSIONS = {"vllm": "vllm-0.8", "sglang": "sglang-0.4"}
ARRIVALS = ("poisson", "on-off", "ramp", "diurnal")
PODS_RANGE = (2, 16)
UTILIZATION_RANGE = (0.3, 0.95)
LORA_OVERSUBSCRIBED_LOAD = 0.6
MAX_ADAPTERS, MAX_SLOTS = 32, 4
TARGET_REQUESTS = 300  # measured requests per scenario, about (sets the duration)
DURATION_RANGE_S = (2.0, 90.0)
MAX_PROMPT_TOKENS = 6000  # user part; every profile's context is 8,192
MAX_OUTPUT_TOKENS = 1024
WARMUP_S = 3.0  # at most; fewer seconds on a fleet that gets more than WARMUP_REQUESTS in it
WARMUP_REQUESTS = 100
WARMUP_GAP_S = 1.5  # after the warm-up's last arrival: its 16-token answers drain
WARMUP_MAX_TOKENS = 16


def scenario(seed: int, index: int) -> Plan:
    """Scenario `index` of the family drawn from `seed`, warm-up included."""
    params = draw_params(seed, index)
    return build_plan(params)


def family(seed: int, count: int) -> Iterator[Plan]:
    """The first `count` scenarios of the family of `seed`."""
    for index in range(count):
        yield scenario(seed, index)


# ----- parameters ---------------------------------------------------------------------------


def draw_params(seed: int, index: int) -> dict[str, Any]:
    """Every knob of one scenario, JSON-able: what the report shows and `build_plan` reads."""
    rng = random.Random(f"family:{seed}:{index}")
    total = rng.randint(*PODS_RANGE)
    n_pools = 2 if total >= 4 and rng.random() < 0.3 else 1
    sizes = [total] if n_pools == 1 else _split(rng, total)
    models = rng.sample(MODELS, n_pools)
    return {
        "name": f"family-{seed}-{index}",
        "seed": seed,
        "index": index,
        "pools": [_draw_pool(rng, model, n) for model, n in zip(models, sizes, strict=True)],
        "utilization": round(rng.uniform(*UTILIZATION_RANGE), 3),
        "arrivals": _draw_arrivals(rng),
        "prompt": {"median": round(_log_uniform(rng, 100, 1500)), "sigma": _r(rng, 0.4, 1.2)},
        "output": {"median": round(_log_uniform(rng, 30, 300)), "sigma": _r(rng, 0.3, 1.0)},
        "prefix": _draw_prefix(rng),
    }


def _draw_pool(rng: random.Random, model: str, pods: int) -> dict[str, Any]:
    gpus = rng.sample(GPUS, min(pods, rng.randint(1, 3)))
    counts = _spread(rng, pods, len(gpus))
    engine = rng.choices([e for e, _ in ENGINES], [w for _, w in ENGINES])[0]
    pool: dict[str, Any] = {
        "model": model,
        "gpus": [[g, n] for g, n in zip(gpus, counts, strict=True)],
        "engine": engine,
        "metrics_version": OLD_VERSIONS.get(engine) if rng.random() < 1 / 3 else None,
        "adapters": 0,
    }
    if rng.random() < 0.4:
        pool.update(adapters=rng.randint(1, MAX_ADAPTERS), slots=rng.randint(1, MAX_SLOTS),
                    adapter_zipf=_r(rng, 0.0, 1.5), lora_load_scale=_r(rng, 0.5, 4.0))
    return pool


def _draw_arrivals(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(ARRIVALS)
    if kind == "on-off":
        return {"kind": kind, "cycles": rng.randint(2, 4), "on_share": _r(rng, 0.2, 0.4),
                "on_load": _r(rng, 1.5, 2.5)}
    if kind == "ramp":
        return {"kind": kind, "swing": _r(rng, 0.3, 0.7), "up": rng.random() < 0.5}
    if kind == "diurnal":
        return {"kind": kind, "swing": _r(rng, 0.3, 0.6), "periods": rng.randint(1, 2),
                "phase": _r(rng, 0.0, 2 * math.pi)}
    return {"kind": kind}


def _draw_prefix(rng: random.Random) -> dict[str, Any] | None:
    if rng.random() < 0.5:
        return None
    groups = rng.randint(1, 8)
    return {"groups": groups, "tokens": [rng.randint(300, 3000) for _ in range(groups)],
            "share": _r(rng, 0.5, 1.0), "zipf": _r(rng, 0.0, 1.5)}


def _split(rng: random.Random, total: int) -> list[int]:
    first = rng.randint(2, total - 2)
    return [first, total - first]


def _spread(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` pods over `parts` GPU types, each at least one."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _r(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), 3)


# ----- plan ---------------------------------------------------------------------------------


def build_plan(params: dict[str, Any]) -> Plan:
    """The scenario's fleet, calibrated load, warm-up and measured requests."""
    rng = random.Random(f"family-plan:{params['seed']}:{params['index']}")
    corpus = Corpus(rng, chars=600_000)
    systems = [corpus.text_of(t) for t in (params["prefix"] or {}).get("tokens", [])]
    pools = [_pool_plan(params, pool, systems, i) for i, pool in enumerate(params["pools"])]
    rate = sum(p.rate for p in pools)
    duration = min(max(TARGET_REQUESTS / rate, DURATION_RANGE_S[0]), DURATION_RANGE_S[1])
    warm_s = min(WARMUP_S, WARMUP_REQUESTS / rate)
    warm = _requests(params, pools, systems, corpus, rng, warm_s, 0.0, warm=True)
    start = warm_s + WARMUP_GAP_S
    measured = _requests(params, pools, systems, corpus, rng, duration, start, warm=False)
    return Plan(params["name"], pools, 1.0, duration, [*warm, *measured], calibration(
        pools, params["utilization"], arrivals=params["arrivals"]["kind"],
        warmup_s=round(warm_s, 3), measured_from_s=round(start, 3), params=params))


def _pool_plan(params: dict[str, Any], pool: dict[str, Any], systems: list[str],
               i: int) -> PoolPlan:
    model = pool["model"]
    pods = [p for gpu, n in pool["gpus"] for p in make_pods(gpu, model, n, f"p{i}")]
    for pod in pods:
        _configure_pod(pod, pool)
    caps = capacities(pods, _workload(params, systems))
    load = params["utilization"]
    if pool["adapters"] > pool.get("slots", pool["adapters"]):
        load *= LORA_OVERSUBSCRIBED_LOAD
    return PoolPlan(model, pods, load * round_robin_capacity(caps), caps)


def _configure_pod(pod: dict[str, Any], pool: dict[str, Any]) -> None:
    """Engine, page version and LoRA settings of the fleet spec (simulator/spec.py)."""
    pod["engine"] = pool["engine"]
    if pool["metrics_version"]:
        pod["metrics_version"] = pool["metrics_version"]
    if pool["adapters"]:
        from simulator.profiles import build_profile

        base = build_profile(pod["gpu"], pod["model"]).lora_load_ms
        pod.update(lora_adapters=adapter_names(pool), max_loras=pool["slots"],
                   profile={"lora_load_ms": round(base * pool["lora_load_scale"], 2)})


def adapter_names(pool: dict[str, Any]) -> list[str]:
    return [f"{pool['model']}-lora-{k}" for k in range(pool["adapters"])]


def _workload(params: dict[str, Any], systems: list[str]) -> Workload:
    """The mean request as a warm pod sees it: shared system prompts cached (only the user
    part is prefilled), their share of the KV cache counted in the prompt."""
    user = lognormal_mean(params["prompt"]["median"], params["prompt"]["sigma"])
    output = lognormal_mean(params["output"]["median"], params["output"]["sigma"])
    prefix = params["prefix"]
    shared = prefix["share"] * sum(len(s) / 4 for s in systems) / len(systems) if prefix else 0.0
    return Workload(prefill_tokens=user, prompt_tokens=user + shared, output_tokens=output)


def _requests(params: dict[str, Any], pools: list[PoolPlan], systems: list[str],
              corpus: Corpus, rng: random.Random, duration: float, start: float,
              warm: bool) -> list[RequestSpec]:
    times = sorted((start + t, p.model) for p in pools
                   for t in arrivals(rng, params["arrivals"], p.rate, duration))
    by_model = {pool["model"]: pool for pool in params["pools"]}
    out = []
    for i, (t, model) in enumerate(times):
        pool = by_model[model]
        name, group = _adapter(rng, pool)
        system = _system(rng, params["prefix"], systems)
        user = corpus.text_of(lognormal(rng, params["prompt"]["median"],
                                        params["prompt"]["sigma"], 16, MAX_PROMPT_TOKENS))
        output = lognormal(rng, params["output"]["median"], params["output"]["sigma"], 4,
                           MAX_OUTPUT_TOKENS)
        if warm:
            output, group = min(output, WARMUP_MAX_TOKENS), WARMUP_GROUP
        out.append(chat_request(i, t, name or model, model, user, output, group, system))
    return out


def _adapter(rng: random.Random, pool: dict[str, Any]) -> tuple[str | None, str]:
    if not pool["adapters"]:
        return None, pool["model"]
    names = adapter_names(pool)
    weights = [1.0 / (k + 1) ** pool["adapter_zipf"] for k in range(len(names))]
    name = rng.choices(names, weights)[0]
    return name, name


def _system(rng: random.Random, prefix: dict[str, Any] | None, systems: list[str]) -> str | None:
    if not prefix or rng.random() >= prefix["share"]:
        return None
    weights = [1.0 / (k + 1) ** prefix["zipf"] for k in range(len(systems))]
    return rng.choices(systems, weights)[0]


# ----- arrivals -----------------------------------------------------------------------------


def arrivals(rng: random.Random, shape: dict[str, Any], mean: float,
             duration: float) -> list[float]:
    """Arrival times in [0, duration) of the shape, at mean rate `mean`."""
    kind = shape["kind"]
    if kind == "on-off":
        period = duration / shape["cycles"]
        on_s = period * shape["on_share"]
        rate_on = mean * shape["on_load"]
        rate_off = max(0.05 * mean, (mean * period - rate_on * on_s) / (period - on_s))
        return on_off_arrivals(rng, rate_on=rate_on, rate_off=rate_off, on_s=on_s,
                               off_s=period - on_s, duration=duration)
    if kind == "poisson":
        return varying_arrivals(rng, lambda t: mean, mean, duration)
    swing = shape["swing"]
    if kind == "ramp":
        sign = 1.0 if shape["up"] else -1.0
        return varying_arrivals(
            rng, lambda t: mean * (1 + sign * swing * (2 * t / duration - 1)),
            mean * (1 + swing), duration)
    omega = 2 * math.pi * shape["periods"] / duration
    return varying_arrivals(
        rng, lambda t: mean * (1 + swing * math.sin(omega * t + shape["phase"])),
        mean * (1 + swing), duration)


def varying_arrivals(rng: random.Random, rate: Callable[[float], float], peak: float,
                     duration: float) -> list[float]:
    """A Poisson process of time-varying `rate` (at most `peak`), by thinning."""
    out: list[float] = []
    t = rng.expovariate(peak)
    while t < duration:
        if rng.random() * peak < rate(t):
            out.append(t)
        t += rng.expovariate(peak)
    return out


def warm_started(plan: Plan, warm: Plan, gap_s: float) -> Plan:
    """`plan` with `warm`'s requests (outputs capped, labelled warm-up) run first and its own
    shifted to start `gap_s` after the warm-up's window: what a live run does before it
    measures (bench/runner.py), for the replay and the twin of a hand-written scenario."""
    from bench.runner import warmup_requests

    shift = warm.duration_s + gap_s
    measured = [dataclasses.replace(r, at=r.at + shift) for r in plan.requests]
    return dataclasses.replace(plan, requests=[*warmup_requests(warm), *measured])


# ----- a sample for live runs ---------------------------------------------------------------

# What a live run can afford per member and configuration on the shared 2-core machine
# (`igw bench --replicas ... --family K`): ~300 measured requests over a 10-25 s arrivals
# window (time_scale 1: at most 30 requests/s, as the five scenarios' 20-25), so a run with
# its warm-up, drain and N replicas' start stays under a minute; at most 12 pods.
SAMPLE_CANDIDATES = 100
SAMPLE_WINDOW_S = (10.0, 25.0)
SAMPLE_MAX_PODS = 12


def traits(params: dict[str, Any]) -> set[str]:
    """The kinds a member is of, for spreading a sample over the family."""
    out = {f"arrivals {params['arrivals']['kind']}"}
    if len(params["pools"]) > 1:
        out.add("two pools")
    if params["prefix"]:
        out.add("shared prompts")
    for pool in params["pools"]:
        out.add(f"engine {pool['engine']}")
        if pool["metrics_version"]:
            out.add("older page")
        if len(pool["gpus"]) > 1:
            out.add("mixed GPUs")
        if pool["adapters"]:
            out.add("LoRA, fewer slots than adapters" if pool["adapters"] > pool["slots"]
                    else "LoRA")
    return out


def sample(seed: int, count: int) -> list[Plan]:
    """`count` members of the family of `seed` a live run can afford (arrivals window within
    SAMPLE_WINDOW_S, at most SAMPLE_MAX_PODS pods; among the first SAMPLE_CANDIDATES),
    spread over its kinds: each pick is the candidate with the most traits no earlier pick
    has (once every trait is had, they count afresh), the lowest index on a tie. Greedy, so
    the first k of a sample of `count` are the sample of k: a larger twin sample contains
    the live one."""
    candidates = [plan for plan in family(seed, SAMPLE_CANDIDATES)
                  if SAMPLE_WINDOW_S[0] <= plan.duration_s <= SAMPLE_WINDOW_S[1]
                  and len(plan.pods) <= SAMPLE_MAX_PODS]
    kinds = [traits(plan.calibration["params"]) for plan in candidates]
    picked: list[int] = []
    covered: set[str] = set()
    while len(picked) < min(count, len(candidates)):
        rest = [i for i in range(len(candidates)) if i not in picked]
        if not any(kinds[i] - covered for i in rest):
            covered = set()
        best = max(rest, key=lambda i: (len(kinds[i] - covered), -i))
        picked.append(best)
        covered |= kinds[best]
    return [candidates[i] for i in picked]


def member_indices(text: str) -> list[int]:
    """Family indices from a command line ("27,92"), for argparse's `type`."""
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated member indices: {text!r}") from None


def sample_of(seed: int, count: int, members: Sequence[int] | None = None) -> list[Plan]:
    """`sample(seed, count)`, only its members whose family index is in `members` when given:
    a change that can move a few of them is re-measured on those alone (every member is
    deterministic, so the others would read as before)."""
    plans = sample(seed, count)
    if members is None:
        return plans
    return [plan for plan in plans if plan.calibration["params"]["index"] in members]


def live_run(member: Plan) -> tuple[Scenario, Plan, Plan]:
    """A member as `igw bench` runs it live (bench/runner.py): (scenario, measured plan,
    warm-up plan). The warm-up is the member's own first requests; the measured ones are
    moved to start at 0, as the runner sends them after the warm-up has drained."""
    start = member.calibration["measured_from_s"]
    warm = [r for r in member.requests if r.group == WARMUP_GROUP]
    measured = dataclasses.replace(member, requests=[
        dataclasses.replace(r, at=r.at - start) for r in member.requests
        if r.group != WARMUP_GROUP])
    params = member.calibration["params"]
    scenario = Scenario(member.scenario, f"{member.scenario} (family seed {params['seed']}, "
                        f"index {params['index']})", (), describe(params), member.time_scale,
                        member.wall_duration_s, lambda _seed, _duration, _scale: measured)
    return scenario, measured, dataclasses.replace(
        member, requests=warm, duration_s=member.calibration["warmup_s"])


# ----- running the family: the twin against the replay's yardsticks --------------------------

YARDSTICKS = ("best-ttft", "least-work", "adapter-affine", "round-robin")
TARGET_RATIO = 1.2  # the target: gateway p95 within 1.2x best-ttft's
# Twin seeds per member by default (`run_scenario`): each figure is their median.
TWIN_SEEDS = 3


def run_scenario(plan: Plan, yardsticks: dict[str, Any] | None = None,
                 twin_seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """One scenario's row: the twin (gateway llm-d) on each of `twin_seeds` (default: the
    family's seed alone), each figure the median over them, and the yardsticks (computed
    unless given: they depend on the plan only, not on the gateway's code), and the ratios.

    Why several seeds: the twin's seed sets its scrape phases and tie-breaks, and those
    alone move one member's p95 by 10 % at the median and by half at the 90th percentile
    (seed 0's family on twin seeds 0, 1 and 2: 75, 70 and 69 % within 1.2x of best-ttft,
    docs/benchmarks.md), so one seed judges a change on its luck."""
    from bench.twin import twin

    measured = measured_indices(plan)
    seeds = list(twin_seeds or (plan.calibration["params"]["seed"],))
    started = time.perf_counter()
    runs = []
    for seed in seeds:
        res = twin(plan, seed=seed)
        runs.append({**res.percentiles(measured), "adapter_loads": res.adapter_loads,
                     "failed": sum(1 for i in measured if res.ttft_s[i] is None)})
    gateway: dict[str, Any] = {key: _median(run[key] for run in runs) for key in runs[0]}
    if len(runs) > 1:
        gateway["twin_seeds"] = seeds
        gateway["p95_by_seed"] = [run["ttft_p95"] for run in runs]
    twin_s = time.perf_counter() - started
    started = time.perf_counter()
    if yardsticks is None:
        yardsticks = replay_reference(plan, YARDSTICKS)
    return {"name": plan.scenario, "params": plan.calibration["params"],
            "fingerprint": fingerprint(plan), "requests": len(measured), "gateway": gateway,
            "yardsticks": yardsticks, "ratios": ratios(gateway, yardsticks),
            "seconds": {"twin": round(twin_s, 2),
                        "yardsticks": round(time.perf_counter() - started, 2)}}


def twin_seeds(seed: int, count: int) -> list[int]:
    """The twin's seeds for a family of `seed`: the family's own seed first (what one seed
    ran before), then the next ones."""
    return [seed + k for k in range(count)]


def _median(values: Iterable[float | None]) -> float | None:
    """The median of a figure over the twin's seeds (None where a run had none: no request
    served), ints kept ints (adapter loads, failed requests)."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    mid = float(np.median(known))
    return round(mid) if all(isinstance(v, int) for v in known) else round(mid, 4)


def ratios(gateway: dict[str, Any], yard: dict[str, Any]) -> dict[str, float | str | None]:
    """Gateway p95 over best-ttft's, round-robin's and the best yardstick's; loads over
    adapter-affine's."""
    def over(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    g95 = gateway["ttft_p95"]
    best_name = min((k for k in yard if yard[k]["ttft_p95"] is not None),
                    key=lambda k: yard[k]["ttft_p95"], default=None)
    affine = yard["adapter-affine"]["adapter_loads"]
    return {
        "vs_best_ttft": over(g95, yard["best-ttft"]["ttft_p95"]),
        "vs_round_robin": over(g95, yard["round-robin"]["ttft_p95"]),
        "best_yardstick": best_name,
        "vs_best_yardstick": over(g95, yard[best_name]["ttft_p95"]) if best_name else None,
        "loads_vs_affine": over(gateway["adapter_loads"], affine) if affine else None,
    }


def fingerprint(plan: Plan) -> str:
    """Identifies a plan's requests and fleet, so cached yardsticks are reused only for it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(orjson.dumps(plan.pods))
    for r in plan.requests:
        digest.update(f"{r.at:.9f}".encode())
        digest.update(r.body)
    return digest.hexdigest()


def aggregate(rows: list[dict[str, Any]], worst: int = 5) -> dict[str, Any]:
    """The distribution of the p95 ratios over the family, and the worst scenarios."""
    best = np.array([r["ratios"]["vs_best_ttft"] for r in rows
                     if r["ratios"]["vs_best_ttft"] is not None])
    rr = np.array([r["ratios"]["vs_round_robin"] for r in rows
                   if r["ratios"]["vs_round_robin"] is not None])
    yard = np.array([r["ratios"]["vs_best_yardstick"] for r in rows
                     if r["ratios"]["vs_best_yardstick"] is not None])
    loads = [r["ratios"]["loads_vs_affine"] for r in rows
             if r["ratios"]["loads_vs_affine"] is not None]
    ranked = sorted(rows, key=lambda r: -(r["ratios"]["vs_best_ttft"] or math.inf))
    return {
        "scenarios": len(rows),
        "vs_best_ttft": _dist(best) | {
            "share_within_target": round(float(np.mean(best <= TARGET_RATIO)), 3)},
        "vs_round_robin": _dist(rr) | {
            "share_over_1.05": round(float(np.mean(rr > 1.05)), 3)},
        "vs_best_yardstick": _dist(yard),
        "loads_vs_affine": {"scenarios": len(loads),
                            "share_within_1.5": round(float(np.mean(np.array(loads) <= 1.5)), 3)
                            if loads else None,
                            "worst": max(loads) if loads else None},
        "failed_requests": sum(r["gateway"]["failed"] for r in rows),
        "worst": [r["name"] for r in ranked[:worst]],
        **_seed_spread(rows),
    }


def _seed_spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How far one member's p95 moves with the twin's seed alone (its largest over its
    smallest), over the members run on several; nothing when each ran on one."""
    seeded = [r for r in rows if "p95_by_seed" in r["gateway"]]
    spread = np.array([max(known) / min(known) for r in seeded
                       if len(known := [v for v in r["gateway"]["p95_by_seed"] if v]) > 1])
    if not len(spread):
        return {}
    every = sum(1 for r in seeded if _within_on_every_seed(r))
    return {"twin_seeds": seeded[0]["gateway"]["twin_seeds"],
            "seed_spread": _dist(spread),
            "share_within_target_every_seed": round(every / len(seeded), 3)}


def _within_on_every_seed(row: dict[str, Any]) -> bool:
    best = row["yardsticks"]["best-ttft"]["ttft_p95"]
    return best is not None and all(
        v is not None and v <= TARGET_RATIO * best for v in row["gateway"]["p95_by_seed"])


def _dist(values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {"median": None, "p90": None, "worst": None}
    return {"median": round(float(np.median(values)), 3),
            "p90": round(float(np.percentile(values, 90)), 3),
            "worst": round(float(values.max()), 3)}


def describe(params: dict[str, Any]) -> str:
    """One line of a scenario's parameters, for the report."""
    prefix = params["prefix"]
    shared = (f", {prefix['groups']} system prompts on {prefix['share']:.0%}" if prefix else "")
    return (f"{'; '.join(_describe_pool(p) for p in params['pools'])}; "
            f"{params['utilization']:.0%} load, {params['arrivals']['kind']}, "
            f"prompt median {params['prompt']['median']} (sigma {params['prompt']['sigma']}), "
            f"output median {params['output']['median']}{shared}")


def _describe_pool(pool: dict[str, Any]) -> str:
    gpus = "+".join(f"{n}x{g}" for g, n in pool["gpus"])
    engine = pool["engine"] + (f" {pool['metrics_version']}" if pool["metrics_version"] else "")
    lora = f", {pool['adapters']} adapters/{pool['slots']} slots" if pool["adapters"] else ""
    return f"{pool['model']} on {gpus} ({engine}{lora})"


FAMILY_HEADING = "## Scenario family"
FAMILY_PLOT = "family-ratios.png"
LIVE_SAMPLE = "family-live.json"  # `--twin-check --family K`'s rows, shown in the section


def run_family(seed: int, count: int, out: Path, twin_only: bool = False,
               seeds: int = TWIN_SEEDS, jobs: int | None = None) -> dict[str, Any]:
    """`igw bench --family N --seed S`: every scenario's row printed as it ends, then the
    aggregate; family.md and family.json written to `out`. `twin_only` reuses the yardsticks
    of a previous family.json for unchanged plans (they do not depend on the gateway);
    `seeds` twin seeds per member (`twin_seeds`), each figure their median; `jobs` members
    run at once, in worker processes (default: one per core; every member is deterministic
    on its own, so the rows are the same however many run at once)."""
    cached = _cached_yardsticks(out / "family.json") if twin_only else {}
    started = time.perf_counter()
    tasks = [(seed, index, seeds, {k: v for k, v in cached.items()
                                   if k[0] == f"family-{seed}-{index}"}) for index in range(count)]
    rows = []
    for row in parallel_map(_member_row, tasks, jobs):
        rows.append(row)
        print(_line(row), flush=True)
    doc = {"seed": seed, "count": count, "twin_only": twin_only,
           "seconds": round(time.perf_counter() - started, 1),
           "aggregate": aggregate(rows), "scenarios": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "family.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    (out / "family.md").write_text(render_markdown(doc))
    update_report(out)
    agg = doc["aggregate"]
    print(f"{count} scenarios in {doc['seconds']:.0f} s; gateway/best-ttft p95 median "
          f"{agg['vs_best_ttft']['median']}, p90 {agg['vs_best_ttft']['p90']}, worst "
          f"{agg['vs_best_ttft']['worst']}, within {TARGET_RATIO}x in "
          f"{agg['vs_best_ttft']['share_within_target']:.0%}; vs round-robin worst "
          f"{agg['vs_round_robin']['worst']}; results: {out / 'family.md'}", flush=True)
    return doc


T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: Sequence[T], jobs: int | None) -> Iterator[R]:
    """`fn` over `items` in order, `jobs` at once in worker processes (default: one per core;
    1: in this process). Members are deterministic on their own, so the results are the same
    however many run at once."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    if jobs == 1:
        yield from map(fn, items)
        return
    with ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(fn, items)


def _member_row(task: tuple[int, int, int, dict[tuple[str, str], Any]]) -> dict[str, Any]:
    """One member's row, from its seed and index (a worker rebuilds the plan: plans are
    large, their recipe is two numbers)."""
    seed, index, seeds, cached = task
    plan = scenario(seed, index)
    return run_scenario(plan, cached.get((plan.scenario, fingerprint(plan))),
                        twin_seeds(seed, seeds))


def _cached_yardsticks(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    if not path.exists():
        return {}
    doc = orjson.loads(path.read_bytes())
    return {(r["name"], r["fingerprint"]): r["yardsticks"] for r in doc.get("scenarios", [])}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _line(row: dict[str, Any]) -> str:
    g, y, r = row["gateway"], row["yardsticks"], row["ratios"]
    return (f"{row['name']}: gateway p50/p95/p99 {_fmt(g['ttft_p50'])}/{_fmt(g['ttft_p95'])}/"
            f"{_fmt(g['ttft_p99'])} s; best-ttft p95 {_fmt(y['best-ttft']['ttft_p95'])}, "
            f"round-robin {_fmt(y['round-robin']['ttft_p95'])}; x best-ttft "
            f"{_fmt(r['vs_best_ttft'], 2)}, x round-robin {_fmt(r['vs_round_robin'], 2)}, x "
            f"{r['best_yardstick']} {_fmt(r['vs_best_yardstick'], 2)}; adapter loads "
            f"{g['adapter_loads']} (affine {y['adapter-affine']['adapter_loads']})")


def render_markdown(doc: dict[str, Any]) -> str:
    """The family report: the aggregate, the worst scenarios with their parameters, and one
    row per scenario."""
    lines = [
        f"# Scenario family: gateway twin vs the replay's yardsticks (seed {doc['seed']}, "
        f"{doc['count']} scenarios)", "",
        f"`igw bench --family {doc['count']} --seed {doc['seed']}{_repeats(doc)}` in "
        f"{doc['seconds']:.0f} s "
        "(bench/family.py, bench/twin.py; method: docs/benchmarks.md, \"Scenario family and "
        "the gateway's twin\"). TTFT in model seconds over the measured requests (the warm-up "
        "is run, not counted); ratios are of TTFT p95.", "",
        *_summary_lines(doc),
        "", "| scenario | parameters | gateway p50 / p95 / p99 | best-ttft p95 | "
        "least-work p95 | adapter-affine p95 | round-robin p95 | x best-ttft | "
        "x round-robin | x best yardstick | adapter loads gateway / affine / rr |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["scenarios"]:
        g, yd, r = row["gateway"], row["yardsticks"], row["ratios"]
        lines.append(
            f"| {row['name']} | {describe(row['params'])} | {_fmt(g['ttft_p50'])} / "
            f"{_fmt(g['ttft_p95'])} / {_fmt(g['ttft_p99'])} | "
            + " | ".join(_fmt(yd[k]["ttft_p95"]) for k in YARDSTICKS)
            + f" | {_fmt(r['vs_best_ttft'], 2)} | {_fmt(r['vs_round_robin'], 2)} | "
            f"{_fmt(r['vs_best_yardstick'], 2)} ({r['best_yardstick']}) | {g['adapter_loads']} "
            f"/ {yd['adapter-affine']['adapter_loads']} / {yd['round-robin']['adapter_loads']} |")
    return "\n".join(lines) + "\n"


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    """The aggregate table, the adapter loads, and the worst scenarios named: what both
    family.md and REPORT.md's family section show."""
    agg = doc["aggregate"]
    by_name = {r["name"]: r for r in doc["scenarios"]}
    b, rr, y, loads = (agg["vs_best_ttft"], agg["vs_round_robin"], agg["vs_best_yardstick"],
                       agg["loads_vs_affine"])
    lines = [
        "| gateway p95 over | median | 90th percentile | worst | share |",
        "| --- | --- | --- | --- | --- |",
        f"| best-ttft | {_fmt(b['median'], 2)} | {_fmt(b['p90'], 2)} | {_fmt(b['worst'], 2)} "
        f"| ≤ {TARGET_RATIO}: {b['share_within_target']:.0%} |",
        f"| round-robin | {_fmt(rr['median'], 2)} | {_fmt(rr['p90'], 2)} | "
        f"{_fmt(rr['worst'], 2)} | > 1.05: {rr['share_over_1.05']:.0%} |",
        f"| best yardstick | {_fmt(y['median'], 2)} | {_fmt(y['p90'], 2)} | "
        f"{_fmt(y['worst'], 2)} | |", "",
        f"Adapter loads over adapter-affine's, {loads['scenarios']} LoRA scenarios: within "
        f"1.5x in {_fmt_share(loads['share_within_1.5'])}, worst {_fmt(loads['worst'], 2)}. "
        f"Failed requests (no pod, admission timeout, refused): {agg['failed_requests']}.", "",
        *_spread_lines(agg),
        "Worst scenarios (gateway over best-ttft at p95):", "",
    ]
    for name in agg["worst"]:
        row = by_name[name]
        lines.append(f"- `{name}` ({_fmt(row['ratios']['vs_best_ttft'], 2)}x): "
                     f"{describe(row['params'])}")
    return lines


def _spread_lines(agg: dict[str, Any]) -> list[str]:
    """What the twin's seed alone does to a member, where members ran on several seeds."""
    if "seed_spread" not in agg:
        return []
    spread = agg["seed_spread"]
    seeds = ", ".join(str(s) for s in agg["twin_seeds"])
    return [f"Each member's gateway figures are the median over the twin's seeds {seeds}. "
            f"The seed alone moves a member's p95 (largest over smallest) by "
            f"{_fmt(spread['median'], 2)}x at the median, {_fmt(spread['p90'], 2)}x at the 90th "
            f"percentile and {_fmt(spread['worst'], 2)}x at worst; "
            f"{agg['share_within_target_every_seed']:.0%} of the members are within "
            f"{TARGET_RATIO}x of best-ttft on every seed.", ""]


def plot_ratios(doc: dict[str, Any], path: Path) -> bool:
    """The distribution of the gateway's p95 over best-ttft's and over round-robin's, one
    empirical CDF each, with the issue's targets marked; False without matplotlib."""
    from bench.report import _plt, finish_cdf

    plt = _plt()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label, target in (("vs_best_ttft", "over best-ttft", TARGET_RATIO),
                               ("vs_round_robin", "over round-robin", 1.05)):
        values = np.sort([r["ratios"][key] for r in doc["scenarios"]
                          if r["ratios"][key] is not None])
        if not len(values):
            continue
        share = np.arange(1, len(values) + 1) / len(values)
        line, = ax.step(values, share, where="post", label=f"gateway p95 {label}")
        ax.axvline(target, color=line.get_color(), linestyle=":", linewidth=1,
                   label=f"target {target:g}x")
    finish_cdf(plt, fig, ax, path, xlabel="gateway TTFT p95 / yardstick's (log scale)",
               ylabel="share of scenarios", marks=(0.9,),
               title=f"Scenario family (seed {doc['seed']}, {doc['count']} scenarios)")
    return True


def update_report(out: Path) -> bool:
    """Put the family's section at the end of `out`/REPORT.md (replacing an older one) and
    draw its plot, from `out`/family.json; False when there is no family.json."""
    source = out / "family.json"
    if not source.exists():
        return False
    doc = orjson.loads(source.read_bytes())
    drawn = plot_ratios(doc, out / FAMILY_PLOT)
    report = out / "REPORT.md"
    text = report.read_text() if report.exists() else ""
    cut = text.find(f"\n{FAMILY_HEADING}")
    text = (text if cut < 0 else text[:cut]).rstrip("\n")
    section = [
        f"{FAMILY_HEADING} (seed {doc['seed']}, {doc['count']} scenarios, the gateway's twin)",
        "", f"`igw bench --family {doc['count']} --seed {doc['seed']}{_repeats(doc)}`: the "
        "gateway's twin "
        "against the perfect-information replay's yardsticks on generated fleets and "
        "workloads its weights were not tuned on (method: docs/benchmarks.md; every scenario: "
        "family.md). Targets: p95 ≤ 1.2x best-ttft in ≥ 90 % of scenarios, median ≤ 1.1, worst "
        "≤ 1.5; never more than 5 % over round-robin; adapter loads within 1.5x of "
        "adapter-affine's.", "",
        *_summary_lines(doc),
    ]
    if drawn:
        section += ["", f"![gateway p95 over the yardsticks, per scenario]({FAMILY_PLOT})"]
    live = out / LIVE_SAMPLE
    if live.exists():
        section += ["", *live_sample_lines(orjson.loads(live.read_bytes()))]
    report.write_text((text + "\n\n" if text else "") + "\n".join(section) + "\n")
    return True


def live_sample_lines(doc: dict[str, Any]) -> list[str]:
    """The live sample against the twin (`igw bench --family K --twin-check`'s
    family-live.json, bench.twin.check_row's rows): per member the live routers' p95 and
    whether the twin ranks the gateway as live does, against round-robin and against the
    best simple alternative."""
    rows = doc["rows"]
    lines = [f"### The family's sample live ({len(rows)} members, {doc['date']})", "",
             f"`{doc['command']}` on the live runs of `igw bench --family {len(rows)} --live "
             f"--routers {','.join(doc['routers'])}` (each member with its own warm-up), the "
             f"twin on the same plans (twin seed {doc['seed']}). Live failures are requests "
             "still unfinished at the run's drain cut; the twin has no cut. Ranking: the "
             "gateway over round-robin (twin: over the "
             "replay's strict rotation) and over the best other router (live: the best open "
             "router that ran; twin: the better of the replay's least-work and adapter-affine), "
             "each ✓ where twin and live fall on the same side of 1.", "",
             "| member | live p95 gateway (s) | twin / live p95 | gateway over round-robin, "
             "twin / live | | gateway over the best other, twin / live | | failed twin / "
             "live |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        agrees = row["agrees"]
        lines.append(
            f"| {row['scenario']} | {row['live']['ttft_p95']:.3f} | {row['p95_ratio']:.2f} | "
            f"{_fmt(row['twin_vs_round_robin'], 2)} / {_fmt(row['live_vs_envoy_rr'], 2)} | "
            f"{_mark(agrees['round_robin'])} | {_fmt(row['twin_vs_other'], 2)} "
            f"({row['twin_other']}) / {_fmt(row.get('live_vs_open_router'), 2)} "
            f"({row.get('live_open_router', 'none ran')}) | {_mark(agrees['other'])} | "
            f"{row['failed']['twin']} / {row['failed']['live']} |")
    lines.append("")
    for key, label in (("round_robin", "round-robin"), ("other", "the best other")):
        judged = [r["agrees"][key] for r in rows if r["agrees"][key] is not None]
        lines.append(f"Against {label} the twin ranks the gateway as live in {sum(judged)} of "
                     f"{len(judged)} members.")
    return lines


def _mark(agrees: bool | None) -> str:
    return "n/a" if agrees is None else ("✓" if agrees else "✗")


def _repeats(doc: dict[str, Any]) -> str:
    """The command's `--repeats` where the run had other than the default twin seeds."""
    seeds = doc["aggregate"].get("twin_seeds", [doc["seed"]])
    return "" if len(seeds) == TWIN_SEEDS else f" --repeats {len(seeds)}"


def _fmt_share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"
