"""The gateway's twin: its own scheduling code driven by the replay's engine model in virtual
time, so a routing change can be judged on a hundred scenarios in minutes instead of live runs.

What is the gateway's own code (imported, not copied):
- per pool a `picker.datastore.Pool` in a `Datastore`, the real `Scheduler` with the configured
  profile (default `llm-d`), its `PoolState` accounting through `on_dispatch` / `on_complete`;
- the request as the director builds it: `bbr.request.parse_request` on the plan's body, the
  pool and adapter from `bbr.model_map.ModelMap`, prefix hashes from `bbr.prefix`;
- scrapes: every pod's page written by the simulator's own page writer for the pod's engine and
  version (`simulator.metrics_text.render`, the exported subset), parsed by the gateway's parser
  for the pool's `engineType` and written into the row by `write_snapshot` with the collector's
  `SpeedLearner`, at the collector's intervals (`next_delay`: the configured interval with its
  ±10 % jitter; the first scrape spread as `FIRST_SCRAPE_SPREAD_S`);
- admission: `pool_saturated` decides, as the director does; waiters are released first come
  first served (every request has priority 0) on each completion and every
  `RECHECK_INTERVAL_S`, and fail after `queueTimeout`.

The engines are bench/replay.py's `ReplayPod`s (simulator.engine in virtual time). The
gateway's clocks run at model time / time_scale and its config is the live benchmark's
(bench/routers.py: interval 50 ms, staleAfter 2 s, queueTimeout 10 s, all in model time), so a
hand-written scenario's twin sees what the live gateway sees at that scale.

Not modelled: Envoy, the network and the picker's own CPU (a request reaches its pod the moment
it is picked; the live run adds the data path's ~1 ms per request, times the scale); the
fallback pods (a pod that refuses a request fails it, as a live 503 would be retried by
no one); scrape failures other than a page the parser refuses; the load generator's
concurrency cap. Same seed, same plan: the same result.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bbr.model_map import ModelMap
from bbr.prefix import prefix_hashes
from bbr.request import parse_request
from bench.replay import ReplayPod, ReplayResult, adapter_loads, measured_indices
from bench.scenarios import Plan
from contract.config import GatewayConfig, MetricsConfig, SaturationConfig, SchedulerConfig
from picker.datalayer.collector import FIRST_SCRAPE_SPREAD_S, CollectorOptions, next_delay
from picker.datalayer.columns import write_snapshot
from picker.datalayer.engines import profile_for
from picker.datalayer.parser import MetricsParseError, parser_for
from picker.datalayer.speed import SpeedLearner
from picker.datastore import Datastore, Pool
from picker.director import MAX_PREFIX_BLOCKS
from picker.scheduling.admission import RECHECK_INTERVAL_S
from picker.scheduling.errors import NoCandidates
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import pool_saturated
from picker.scheduling.scheduler import Scheduler
from simulator import metrics_text
from simulator.engine import PromptTooLong, QueueFull, SimRequest
from simulator.server import build_request
from simulator.spec import PodSpec, parse_fleet

CHAT_PATH = "/v1/chat/completions"
# The live benchmark's gateway config (bench/routers.py `gateway_config`), in model seconds.
INTERVAL_S, STALE_AFTER_S, QUEUE_TIMEOUT_S = 0.05, 2.0, 10.0


class _Clock:
    """Stands in for the event loop an engine reads its time from (`Engine.now`), so the page
    writer's time-dependent gauges (SGLang's throughput) read virtual time."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        return self.t


@dataclass(eq=False)
class _Sent:
    """One measured or warm-up request from the gateway's point of view."""

    arrival: float  # model time it reached the gateway
    body: dict[str, Any]
    spec_model: str
    pool: str
    request: SchedulingRequest
    sim: SimRequest | None = None
    row: int = -1
    pod: str | None = None
    deadline: float = math.inf  # admission: model time it stops waiting


@dataclass(eq=False)
class _TwinPod:
    replay: ReplayPod
    pool: str
    row: int
    kind: str
    options: metrics_text.PageOptions
    pending: list[_Sent] = field(default_factory=list)
    finished_seen: int = 0


@dataclass(eq=False)
class _TwinPool:
    pool: Pool
    scheduler: Scheduler
    base_model: str
    waiters: deque[_Sent] = field(default_factory=deque)
    recheck_due: bool = False


class Twin:
    """One plan through the gateway's scheduling code; `run()` once."""

    def __init__(self, plan: Plan, profile: str = "llm-d", seed: int = 0) -> None:
        self.plan = plan
        self.profile = profile
        self.scale = plan.time_scale
        self.clock = _Clock()
        self.rand = random.Random(seed)
        self.options = CollectorOptions()
        self.learner = SpeedLearner(self.options.alpha)
        self.datastore = Datastore(GatewayConfig(schedulers=tuple(
            _scheduler_config(i, pool.model, pool.pods, profile, self.scale)
            for i, pool in enumerate(plan.pools))))
        self.model_map = ModelMap.from_pools(
            ((s.name, s.model_name, s.lora_adapters) for s in self.datastore.config.schedulers),
            created=0)
        rng = np.random.default_rng(seed)
        specs = {s.name: s for s in parse_fleet({"pods": plan.pods}).pods}
        self.pools: dict[str, _TwinPool] = {}
        self.pods: list[_TwinPod] = []
        self.by_row: dict[tuple[str, int], _TwinPod] = {}
        for cfg, plan_pool in zip(self.datastore.config.schedulers, plan.pools, strict=True):
            pool = self.datastore.pools[cfg.name]
            self.pools[cfg.name] = _TwinPool(pool, Scheduler(pool, rng=rng), plan_pool.model)
            for entry in plan_pool.pods:
                self._add_pod(cfg.name, pool, specs[entry["name"]])
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.sent: list[_Sent | None] = []
        self.open = 0  # requests neither finished nor failed

    # -- setup ------------------------------------------------------------------------------

    def _add_pod(self, pool_name: str, pool: Pool, spec: PodSpec) -> None:
        pod = pool.add_pod(spec.name, name=spec.name)
        replay = ReplayPod(spec)
        replay.engine._loop = self.clock  # type: ignore[assignment]  # see _Clock
        twin = _TwinPod(replay, pool_name, pod.row, spec.engine, spec.page_options())
        self.pods.append(twin)
        self.by_row[(pool_name, pod.row)] = twin

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> ReplayResult:
        """Every request of the plan; TTFT (model seconds from arrival at the gateway) per
        request in plan order, None for those that failed (no pod, queue timeout, refused)."""
        for i, spec in enumerate(self.plan.requests):
            self._push(spec.at, "arrival", i)
        for pod in self.pods:
            spread = min(self._interval_s(), FIRST_SCRAPE_SPREAD_S)
            self._push(self.rand.uniform(0.0, spread) * self.scale, "scrape", pod)
        self.sent = [None] * len(self.plan.requests)
        self.open = len(self.plan.requests)
        loads_before: int | None = None
        first_measured = self.plan.requests[measured_indices(self.plan)[0]].at
        while self.open > 0:
            busy = [p for p in self.pods if p.replay.end is not None]
            next_end = min((p.replay.end for p in busy), default=math.inf)  # type: ignore[type-var]
            if self.events and self.events[0][0] < next_end:
                t, _, kind, payload = heapq.heappop(self.events)
                if loads_before is None and t >= first_measured:
                    loads_before = adapter_loads(p.replay for p in self.pods)
                self.clock.t = t
                self._handle(kind, payload, t)
            else:
                self.clock.t = next_end
                for pod in busy:
                    if pod.replay.end == next_end:
                        pod.replay.run_until(next_end)
                        self._completions(pod, next_end)
        ttft = [s.sim.first_token_at - s.arrival
                if s is not None and s.sim is not None and s.sim.generated else None
                for s in self.sent]
        loads = adapter_loads(p.replay for p in self.pods) - (loads_before or 0)
        return ReplayResult(f"gateway {self.profile}", ttft,
                            [s.pod if s is not None else None for s in self.sent], loads)

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _handle(self, kind: str, payload: Any, t: float) -> None:
        if kind == "arrival":
            self._arrive(payload, t)
        elif kind == "scrape":
            self._scrape(payload, t)
        else:  # "recheck": the admission queue's periodic look
            tp: _TwinPool = payload
            tp.recheck_due = False
            self._release(tp, t)

    def _interval_s(self) -> float:
        return INTERVAL_S / self.scale

    # -- requests ---------------------------------------------------------------------------

    def _arrive(self, position: int, t: float) -> None:
        spec = self.plan.requests[position]
        parsed = parse_request(spec.body, CHAT_PATH, "application/json", None,
                               self.datastore.config.bbr.max_request_body_bytes)
        route = self.model_map.resolve(parsed.model)
        request = SchedulingRequest(
            model=parsed.model, adapter=route.adapter, prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens,
            prefix_hashes=prefix_hashes(parsed.model, parsed.prompt, MAX_PREFIX_BLOCKS))
        sent = _Sent(t, orjson.loads(spec.body), spec.model, route.pool, request)
        self.sent[position] = sent
        tp = self.pools[route.pool]
        now = t / self.scale
        if tp.waiters or pool_saturated(tp.pool, now):
            sent.deadline = t + tp.pool.config.saturation.queue_timeout_s * self.scale
            tp.waiters.append(sent)
            self._schedule_recheck(tp, t)
            return
        self._dispatch(tp, sent, t)

    def _dispatch(self, tp: _TwinPool, sent: _Sent, t: float) -> None:
        now = t / self.scale
        try:
            pick = tp.scheduler.pick(sent.request, now)
        except NoCandidates:
            self._fail()
            return
        row = int(pick.rows[0])
        tp.scheduler.on_dispatch(row, sent.request, now, pick.cached)
        pod = self.by_row[(tp.pool.name, row)]
        sim, _ = build_request(sent.body, sent.spec_model, tp.base_model, True)
        sent.row, sent.pod = row, pod.replay.spec.name
        try:
            pod.replay.add(sim, t)
        except (QueueFull, PromptTooLong):
            tp.scheduler.on_complete(row, sent.request, now, now - sent.arrival / self.scale,
                                     False, address=tp.pool.row_address[row])
            self._fail()
            return
        sent.sim = sim
        pod.pending.append(sent)

    def _completions(self, pod: _TwinPod, t: float) -> None:
        """The requests that ended in the iteration just run: the director's `complete`."""
        done = sum(pod.replay.engine.stats.success.values())
        if done == pod.finished_seen:
            return
        pod.finished_seen = done
        tp = self.pools[pod.pool]
        now = t / self.scale
        keep = []
        for sent in pod.pending:
            if sent.sim is not None and sent.sim.finished:
                tp.scheduler.on_complete(sent.row, sent.request, now,
                                         now - sent.arrival / self.scale, True,
                                         address=tp.pool.row_address[sent.row])
                self.open -= 1
            else:
                keep.append(sent)
        pod.pending = keep
        self._release(tp, t)

    def _fail(self) -> None:
        self.open -= 1

    # -- admission --------------------------------------------------------------------------

    def _release(self, tp: _TwinPool, t: float) -> None:
        """Waiters out while the pool is not saturated (each dispatch re-checks, as the
        queue's listener does); those past their timeout fail."""
        now = t / self.scale
        while tp.waiters and tp.waiters[0].deadline <= t:
            tp.waiters.popleft()
            self._fail()
        while tp.waiters and not pool_saturated(tp.pool, now):
            self._dispatch(tp, tp.waiters.popleft(), t)
        if tp.waiters:
            self._schedule_recheck(tp, t)

    def _schedule_recheck(self, tp: _TwinPool, t: float) -> None:
        if not tp.recheck_due:
            tp.recheck_due = True
            self._push(t + RECHECK_INTERVAL_S * self.scale, "recheck", tp)

    # -- scrapes ----------------------------------------------------------------------------

    def _scrape(self, pod: _TwinPod, t: float) -> None:
        """The collector's `scrape_once` on the pod's page as the simulator writes it."""
        pool = self.pools[pod.pool].pool
        body = metrics_text.render(pod.replay.engine, pod.kind, pod.options)
        now = t / self.scale
        try:
            snapshot = parser_for(profile_for(pool.config.engine_type)).parse(body.decode())
        except MetricsParseError:
            pool.mark_scrape(pod.row, False, now=now)
            failures = 1
        else:
            write_snapshot(pool, pod.row, snapshot, self.learner, now)
            failures = 0
        if self.open > 0:
            delay = next_delay(pool.config.metrics, failures, self.options, self.rand)
            self._push(t + delay * self.scale, "scrape", pod)


def _scheduler_config(i: int, model: str, pods: list[dict[str, Any]], profile: str,
                      scale: float) -> SchedulerConfig:
    """The pool's scheduler entry as bench/routers.py writes it, in the gateway's clock."""
    adapters = sorted({a for p in pods for a in p.get("lora_adapters", ())})
    return SchedulerConfig(
        name=f"pool-{i}", model_name=model, scheduler=profile,
        engine_type=pods[0].get("engine", "vllm"), lora_adapters=tuple(adapters),
        metrics=MetricsConfig(interval_s=INTERVAL_S / scale, stale_after_s=STALE_AFTER_S / scale),
        saturation=SaturationConfig(queue_timeout_s=QUEUE_TIMEOUT_S / scale))


def twin(plan: Plan, profile: str = "llm-d", seed: int = 0) -> ReplayResult:
    """The gateway's TTFTs on `plan` (see `Twin`)."""
    return Twin(plan, profile, seed).run()


def live_check(names: list[str], seed: int, results: Path) -> list[dict[str, Any]]:
    """The twin on a hand-written scenario's plan with the live run's warm-up (the plan of
    seed + 1000, 3 s wall, bench/cli.py), against the live gateway llm-d's figures in
    results/<scenario>.json: their p95 ratio says whether the twin can stand in for it."""
    from bench.family import warm_started
    from bench.scenarios import SCENARIOS

    rows = []
    for name in names:
        path = results / f"{name}.json"
        if not path.exists():
            continue
        doc = orjson.loads(path.read_bytes())
        live = next((s for s in doc["summaries"] if s.get("router") == "igw-llm-d"), None)
        if live is None:
            continue
        scenario = SCENARIOS[name]
        scale = doc["time_scale"]
        plan = scenario.plan(seed, doc["duration_model_s"] / scale, scale)
        warm = scenario.plan(seed + 1000, 3.0, scale)
        ours = twin(warm_started(plan, warm, scale), seed=seed)
        figs = ours.percentiles(measured_indices(warm_started(plan, warm, scale)))
        rows.append({"scenario": name, "twin": figs,
                     "live": {k: live[k] for k in ("ttft_p50", "ttft_p95", "ttft_p99")},
                     "p95_ratio": round(figs["ttft_p95"] / live["ttft_p95"], 3)})
        print(f"{name}: twin p50/p95/p99 {figs['ttft_p50']}/{figs['ttft_p95']}/"
              f"{figs['ttft_p99']} s, live {live['ttft_p50']}/{live['ttft_p95']}/"
              f"{live['ttft_p99']} s, p95 twin/live {rows[-1]['p95_ratio']}", flush=True)
    return rows
