"""Perfect-information replay: a scenario's requests through the simulator's own engine model in
virtual time, routed by reference policies that see every pod's exact state.

The live benchmark measures routers on a real data path, where signals are a scrape old and
Envoy's two workers interleave their round-robin. The replay takes the same plan (the same
bodies, hence the same prompt tokens and block hashes, through `simulator.server.build_request`)
and the same engine model (`simulator.engine.Engine`: batching, token budget, KV cache and
prefix cache, LoRA slots), with no clock and no network, so it shows what routing alone can
reach in the scenario:

- `round-robin`: each pool's pods in strict rotation, request by request (Envoy's
  `ROUND_ROBIN` without its per-worker interleaving).
- `least-work`: the pod whose queued prefill is done soonest (the running iteration's rest plus
  the waiting prompts over the pod's prefill rate), known exactly.
- `best-ttft`: each request to the pod where its own first token comes soonest, found by
  running a copy of each candidate pod forward. A router that decides one request at a time
  without knowing the future has no better information; a router that knew the future could
  still beat it, so it is a reference, not a lower bound.
- `adapter-affine`: a LoRA request to the least-work pod among those where its adapter is
  resident or already queued (so it loads there anyway) if that pod's queued prefill is within
  `AFFINE_SLACK_S` of the least-loaded pod's, else (and for base-model requests) least-work:
  the yardstick for adapter loads.

Every policy's adapter loads are counted (the engine's own `LoraSlots.loads`), from the first
request that is not warm-up (`group == "warmup"`, bench/runner.py) on.

Times are model seconds, like the live results.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from bench.scenarios import Plan
from simulator.engine import Engine, PromptTooLong, QueueFull, SimRequest
from simulator.kv_cache import Allocation
from simulator.server import build_request
from simulator.spec import PodSpec, parse_fleet
from simulator.stats import EngineStats

POLICIES = ("round-robin", "least-work", "best-ttft")
# bench.runner.warmup_requests labels the warm-up traffic so; it is run, never measured.
WARMUP_GROUP = "warmup"
ALL_POLICIES = (*POLICIES, "adapter-affine")
# How much more queued prefill an adapter-affine pod may have than the least-loaded one
# (model seconds): about one A10G prefill of a median chat prompt.
AFFINE_SLACK_S = 0.25


class ReplayPod:
    """One pod's engine stepped by the replay's clock instead of an asyncio loop."""

    __slots__ = ("end", "engine", "spec", "start")

    def __init__(self, spec: PodSpec) -> None:
        self.spec = spec
        self.engine = Engine(spec.engine_config(spec.build_profile()))
        self.start: float | None = None  # the running iteration's start and end, if any
        self.end: float | None = None

    def run_until(self, t: float) -> None:
        """Finish every iteration that ends at or before model time t."""
        while self.end is not None and self.end <= t:
            assert self.start is not None
            start, end = self.start, self.end
            self.engine.end_iteration(start, end)
            self._begin(end)

    def add(self, req: SimRequest, t: float) -> None:
        """Queue req at t (raises QueueFull / PromptTooLong like a live pod); an idle pod
        starts an iteration at once."""
        self.engine.submit(req, at=t)
        if self.end is None:
            self._begin(t)

    def queued_prefill_s(self, t: float) -> float:
        """When this pod would be done with the prefill already queued on it, from t."""
        eng = self.engine
        waiting = sum(r.prompt_tokens for r in eng.waiting)
        rest = (self.end - t) if self.end is not None else 0.0
        return rest + waiting / eng.profile.prefill_tokens_per_s

    def has_adapter(self, adapter: str) -> bool:
        """The adapter is resident (loaded, perhaps idle) or queued here (it will load)."""
        eng = self.engine
        return adapter in eng.lora.resident or any(r.adapter == adapter for r in eng.waiting)

    def first_token_in(self, req: SimRequest, t: float) -> float:
        """req's TTFT if it were queued here at t and nothing else arrived (inf if refused)."""
        trial = self.fork()
        probe = copy.copy(req)
        try:
            trial.add(probe, t)
        except (QueueFull, PromptTooLong):
            return math.inf
        while probe.generated == 0 and trial.end is not None:
            trial.run_until(trial.end)
        return probe.first_token_at - t if probe.generated else math.inf

    def fork(self) -> ReplayPod:
        """A copy to run forward without touching this pod: the same as `copy.deepcopy`
        (tests/test_bench_family.py checks it) but ~10x cheaper, sharing what the engine never
        mutates (spec, config, profile, requests' prompt hashes) and copying the rest at C
        speed; the copy's statistics start empty (a trial reads only its probe's times)."""
        trial = copy.copy(self)
        eng = trial.engine = copy.copy(self.engine)
        eng.stats = EngineStats()
        kv = eng.kv = copy.copy(eng.kv)
        kv._refs = dict(kv._refs)
        kv._evictable = OrderedDict(kv._evictable)
        lora = eng.lora = copy.copy(eng.lora)
        lora._resident = OrderedDict(lora._resident)
        eng._lora_series = OrderedDict(eng._lora_series)
        eng.running = [_fork_request(r) for r in eng.running]
        eng.waiting = deque(_fork_request(r) for r in eng.waiting)
        return trial

    def _begin(self, t: float) -> None:
        eng = self.engine
        if not eng.running and not eng.waiting:
            self.start = self.end = None
            return
        duration = eng.begin_iteration(t)
        if eng.running:
            self.start, self.end = t, t + duration
        else:  # nothing admissible until something changes; the next arrival retries
            self.start = self.end = None


def _fork_request(req: SimRequest) -> SimRequest:
    """A request's engine state, its block allocation copied (the engine grows it)."""
    out = copy.copy(req)
    if req.alloc is not None:
        out.alloc = Allocation(list(req.alloc.hashed), req.alloc.anonymous)
    return out


Chooser = Callable[[list[ReplayPod], SimRequest, float, int], int]


def _round_robin(pods: list[ReplayPod], req: SimRequest, t: float, turn: int) -> int:
    return turn % len(pods)


def _least_work(pods: list[ReplayPod], req: SimRequest, t: float, turn: int) -> int:
    return int(np.argmin([p.queued_prefill_s(t) for p in pods]))


def _best_ttft(pods: list[ReplayPod], req: SimRequest, t: float, turn: int) -> int:
    return int(np.argmin([p.first_token_in(req, t) for p in pods]))


def _adapter_affine(pods: list[ReplayPod], req: SimRequest, t: float, turn: int) -> int:
    work = np.array([p.queued_prefill_s(t) for p in pods])
    if req.adapter is not None:
        bound = work.min() + AFFINE_SLACK_S
        affine = [i for i, p in enumerate(pods) if work[i] <= bound and p.has_adapter(req.adapter)]
        if affine:
            return min(affine, key=lambda i: work[i])
    return int(np.argmin(work))


CHOOSERS: dict[str, Chooser] = {
    "round-robin": _round_robin, "least-work": _least_work, "best-ttft": _best_ttft,
    "adapter-affine": _adapter_affine,
}


@dataclass(frozen=True)
class ReplayResult:
    """TTFT per request in plan order (None: refused or never served), where each went, and
    the adapter loads the pods did from the first measured (not warm-up) request on."""

    policy: str
    ttft_s: list[float | None]
    pods: list[str | None]
    adapter_loads: int = 0

    def percentiles(self, indices: Iterable[int] | None = None) -> dict[str, float | None]:
        idx = range(len(self.ttft_s)) if indices is None else indices
        vals = [t for i in idx if (t := self.ttft_s[i]) is not None]
        if not vals:
            return {f"ttft_p{q}": None for q in (50, 95, 99)}
        arr = np.asarray(vals, dtype=float)
        return {f"ttft_p{q}": round(float(np.percentile(arr, q)), 4) for q in (50, 95, 99)}


def _pools(plan: Plan) -> dict[str, list[ReplayPod]]:
    specs = {s.name: s for s in parse_fleet({"pods": plan.pods}).pods}
    return {pool.model: [ReplayPod(specs[p["name"]]) for p in pool.pods] for pool in plan.pools}


def replay(plan: Plan, policy: str) -> ReplayResult:
    """Every request of the plan, in arrival order, through fresh pods under one policy."""
    if policy not in CHOOSERS:
        raise ValueError(f"unknown replay policy {policy!r}; known: {', '.join(ALL_POLICIES)}")
    choose = CHOOSERS[policy]
    pools = _pools(plan)
    every = [p for pods in pools.values() for p in pods]
    turns = dict.fromkeys(pools, 0)
    placed: list[tuple[SimRequest | None, str | None]] = []
    loads_before: int | None = None
    for spec in plan.requests:
        for pod in every:
            pod.run_until(spec.at)
        if loads_before is None and spec.group != WARMUP_GROUP:
            loads_before = adapter_loads(every)
        pods = pools[spec.pool]
        body: dict[str, Any] = orjson.loads(spec.body)
        req, _ = build_request(body, spec.model, pods[0].spec.model, "messages" in body)
        pod = pods[choose(pods, req, spec.at, turns[spec.pool])]
        turns[spec.pool] += 1
        try:
            pod.add(req, spec.at)
        except (QueueFull, PromptTooLong):
            placed.append((None, pod.spec.name))
            continue
        placed.append((req, pod.spec.name))
    for pod in every:
        pod.run_until(math.inf)
    ttft = [r.first_token_at - r.arrival if r is not None and r.generated else None
            for r, _ in placed]
    loads = adapter_loads(every) - (loads_before or 0)
    return ReplayResult(policy, ttft, [name for _, name in placed], loads)


def adapter_loads(pods: Iterable[ReplayPod]) -> int:
    """Adapters the pods' engines loaded so far (each load costs the pod `lora_load_ms`)."""
    return sum(p.engine.lora.loads for p in pods)


def replay_reference(plan: Plan, policies: Iterable[str] = POLICIES) -> dict[str, Any]:
    """TTFT percentiles of each reference policy (and per pool when there are several)."""
    out: dict[str, Any] = {}
    measured = measured_indices(plan)
    pool_of = [s.pool for s in plan.requests]
    for policy in policies:
        res = replay(plan, policy)
        entry: dict[str, Any] = res.percentiles(measured)
        entry["adapter_loads"] = res.adapter_loads
        if len(plan.pools) > 1:
            entry["per_pool"] = {
                pool.model: res.percentiles(i for i in measured if pool_of[i] == pool.model)
                for pool in plan.pools
            }
        out[policy] = entry
    return out


def measured_indices(plan: Plan) -> list[int]:
    """Positions of the plan's requests that count (all but a prefixed warm-up)."""
    return [i for i, s in enumerate(plan.requests) if s.group != WARMUP_GROUP]
