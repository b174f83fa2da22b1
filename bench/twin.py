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
- admission and flow control: per pool the gateway's `Admission` (picker.scheduling.admission,
  the decisions of the director's `AdmissionQueue` without its futures), so a request waits
  as live while the pool is saturated, a pod's committed prefill would pass
  `saturation.maxStartDelay`, or the pool's requests in flight reach its learned slots +
  `slotAllowance` (picker.scheduling.flow), in the fair queue's order (picker.scheduling.
  fair_queue; every request here has priority 0 and no tenant). Waiters are released as the
  live queue releases them: one per look, a look soon (the event loop's `call_soon`: at the
  same virtual time, after what is already due then) after each dispatch and completion,
  local or folded from another replica (the scheduler's listener), and every
  `RECHECK_INTERVAL_S` while anyone waits (its ticker, started by the first waiter); a
  waiter fails after `queueTimeout`, and a full queue refuses (`queueSize`) as live. A
  released waiter is dispatched at once (live, its caller resumes first: one event loop
  turn).

The engines are bench/replay.py's `ReplayPod`s (simulator.engine in virtual time). The
gateway's clocks run at model time / time_scale and its config is the live benchmark's
(bench/routers.py: interval 50 ms, staleAfter 2 s, queueTimeout 10 s, all in model time), so a
hand-written scenario's twin sees what the live gateway sees at that scale.

**N replicas** (`replicas=N`, what `igw bench --replicas` runs live, bench/replicas.py): N
independent gateways (each its own Datastore, Schedulers, speed learner and scrape clock with
its own jitter) over the same pods. Each request reaches a replica as in the live bench: the
load generator's clients (bench/loadgen.py `clients_of`, 32 of them) keep their own keep-alive
pools and the L4 front gives every *new connection* the next replica in strict rotation
(`_Front`), so the split is per connection, not per request. Uncoordinated, a replica never
hears of the others' requests. Coordinated (`coordinated=True`), each replica runs the
gateway's coordination code with Redis replaced by a delay: the director's `Outbox`, flushed
as Coordinator._flush_loop does (a batch with a dispatch at once when the last batch with one
left at least `flushInterval` before, else `flushInterval` after it; one without, at once or
`flushInterval` after the last batch of any kind; contract.config `CoordinationConfig`,
10 ms; `flush_interval_s` sets another) through the codec (`encode_batches` / `decode_batch`), each
entry reaching every other replica `rtt_s` later, where `Folder` folds it
(`Scheduler.on_remote_dispatch`, `Replicas` releasing through `on_remote_complete`);
heartbeats and the sweep every `heartbeatInterval`; a fold wakes the receiver's admission
waiters as the scheduler's listener does live. With
`share_scrapes=True` the replicas also share scrape results (`SharedScrapes`: one owner per pod
scrapes it and its result travels in the same batches; the others skip their scrape while it
is fresh). One replica never coordinates (no one to coordinate with), as live.

Not modelled: Envoy, the network and the picker's own CPU (a request reaches its pod the moment
it is picked; the live run adds the data path's ~1 ms per request, times the scale, and N
replicas on the live bench's 2 cores add contention: the twin has none of it); the fallback
pods (a pod that refuses a request fails it, as a live 503 would be retried by no one); scrape
failures other than a page the parser refuses; the load generator's concurrency cap; Redis
outages; the connections the live bench's readiness probes take (they shift the front's
rotation by a few). Same seed, same plan: the same result.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import orjson

from bbr.model_map import ModelMap
from bbr.prefix import prefix_hashes
from bbr.request import parse_request
from bench.loadgen import KEEPALIVE_S, clients_of
from bench.replay import (
    WARMUP_GROUP,
    ReplayPod,
    ReplayResult,
    adapter_loads,
    measured_indices,
)
from bench.replicas import CLIENTS
from bench.scenarios import Plan
from contract.config import (
    CoordinationConfig,
    GatewayConfig,
    MetricsConfig,
    SaturationConfig,
    SchedulerConfig,
)
from picker.coordination.codec import decode_batch, encode_batches
from picker.coordination.fold import Folder
from picker.coordination.outbox import Outbox
from picker.coordination.replicas import Replicas
from picker.coordination.scrapes import SharedScrapes
from picker.datalayer.collector import FIRST_SCRAPE_SPREAD_S, MetricsCollector, next_delay
from picker.datalayer.columns import write_snapshot
from picker.datalayer.engines import profile_for
from picker.datalayer.parser import MetricsParseError, MetricsSnapshot, parser_for
from picker.datastore import Datastore, Pool
from picker.director import MAX_PREFIX_BLOCKS
from picker.scheduling.admission import RECHECK_INTERVAL_S, Admission
from picker.scheduling.errors import NoCandidates, Overloaded
from picker.scheduling.fair_queue import Entry
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.scheduler import Scheduler
from simulator import metrics_text
from simulator.engine import PromptTooLong, QueueFull, SimRequest
from simulator.server import build_request
from simulator.spec import PodSpec, parse_fleet

if TYPE_CHECKING:
    from picker.director import Director

CHAT_PATH = "/v1/chat/completions"
# The live benchmark's gateway config (bench/routers.py `gateway_config`), in model seconds.
INTERVAL_S, STALE_AFTER_S, QUEUE_TIMEOUT_S = 0.05, 2.0, 10.0
# One hop through Redis on loopback, gateway seconds: the XADD's round trip and the peer's
# blocked XREAD returning (docs/benchmarks.md: ~1 ms).
REDIS_RTT_S = 0.001


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

    position: int  # in the plan
    arrival: float  # model time it reached the gateway
    body: dict[str, Any]
    spec_model: str
    pool: str
    request: SchedulingRequest
    gateway: _Gateway  # the replica the front gave its connection to
    sim: SimRequest | None = None
    row: int = -1
    pod: str | None = None
    entry: Entry | None = None  # its place in the admission queue, once held
    shared_id: int = 0  # coordinated: the id its completion carries to the other replicas


@dataclass(eq=False)
class _TwinPod:
    replay: ReplayPod
    pool: str
    row: int  # the same in every replica: each adds the pods in the plan's order
    kind: str
    options: metrics_text.PageOptions
    pending: list[_Sent] = field(default_factory=list)
    finished_seen: int = 0


@dataclass(eq=False)
class _TwinPool:
    pool: Pool
    scheduler: Scheduler
    base_model: str
    admission: Admission[_Sent]
    look_due: bool = False  # a look at the queue is due (AdmissionQueue._scheduled)
    ticking: bool = False  # its periodic re-check runs (AdmissionQueue._ticker)


@dataclass(eq=False)
class _Link:
    """One replica's coordination as picker.coordination.Coordinator runs it, Redis aside."""

    outbox: Outbox
    replicas: Replicas
    folder: Folder
    shares: SharedScrapes | None
    seq: int = 0
    # Model time the next flush is scheduled for (inf: none); an earlier one replaces it, and
    # a scheduled flush whose time is no longer this one does nothing.
    due_at: float = math.inf
    flushed_at: float = -math.inf  # model time the last batch with events or scrapes left
    dispatched_at: float = -math.inf  # the same for the last batch with a dispatch


@dataclass(eq=False)
class _Gateway:
    """One gateway replica: its own datastore and schedulers, speed learner (the collector's)
    and scrape clock. `datastore` and `schedulers` are what `Folder` reads of a Director."""

    name: str
    datastore: Datastore
    model_map: ModelMap
    collector: MetricsCollector
    rand: random.Random
    pools: dict[str, _TwinPool]
    schedulers: dict[str, Scheduler]
    link: _Link | None = None


class _Front:
    """Which replica each request reaches, as on the live bench (bench/replicas.py): each
    request is sent by one of the load generator's clients (`clients_of`; the warm-up and the
    measured run are two LoadGenerators, each drawing its own and opening its own pools),
    over an idle keep-alive connection of that client's pool if it has one (aiohttp takes
    the one released longest ago and drops those idle over KEEPALIVE_S), else over a new
    connection, which the front's tcp_proxy gives to the next replica in strict rotation."""

    def __init__(self, plan: Plan, replicas: int, clients: int) -> None:
        self.replicas = replicas
        self.measured = [s.group != WARMUP_GROUP for s in plan.requests]
        warm = self.measured.count(False)
        self.client_of = [*clients_of(warm, clients),
                          *clients_of(len(plan.requests) - warm, clients)]
        self.idle: dict[bool, list[deque[tuple[int, float]]]] = {
            phase: [deque() for _ in range(clients)] for phase in (False, True)}
        self.keepalive = KEEPALIVE_S * plan.time_scale
        self.turn = 0

    def acquire(self, position: int, t: float) -> int:
        """The replica of the connection request `position` goes over at model time t."""
        idle = self.idle[self.measured[position]][self.client_of[position]]
        while idle:
            replica, released = idle.popleft()
            if t - released <= self.keepalive:
                return replica
        replica = self.turn % self.replicas
        self.turn += 1
        return replica

    def release(self, position: int, replica: int, t: float) -> None:
        """The request's answer ended at t: its connection is idle in its client's pool."""
        self.idle[self.measured[position]][self.client_of[position]].append((replica, t))


# Called at each dispatch before the pick, with the twin, the pool, the request and the model
# time (bench/decisions.py): a diagnostic's look at what the gateway is about to decide.
Observer = Callable[["Twin", _TwinPool, _Sent, float], None]


class Twin:
    """One plan through the gateway's scheduling code, as one replica or N; `run()` once."""

    def __init__(self, plan: Plan, profile: str = "llm-d", seed: int = 0, *, replicas: int = 1,
                 coordinated: bool = False, share_scrapes: bool = False,
                 flush_interval_s: float | None = None, rtt_s: float = REDIS_RTT_S,
                 clients: int = CLIENTS, observe: Observer | None = None) -> None:
        if share_scrapes and not coordinated:
            raise ValueError("shared scrape results need coordinated replicas")
        self.plan = plan
        self.profile = profile
        self.scale = plan.time_scale
        self.clock = _Clock()
        self.config = GatewayConfig(schedulers=tuple(
            _scheduler_config(i, pool.model, pool.pods, profile, self.scale)
            for i, pool in enumerate(plan.pools)))
        # one replica has no one to coordinate with (the live bench runs it uncoordinated);
        # flushInterval as configured unless given (0 with rtt_s 0: coordination without delay)
        settings = CoordinationConfig(url="redis://twin", share_scrapes=share_scrapes)
        if flush_interval_s is not None:
            settings = dataclasses.replace(settings, flush_interval_s=flush_interval_s)
        self.coordination = settings if coordinated and replicas > 1 else None
        self.rtt_s = rtt_s
        self.observe = observe
        self.front = _Front(plan, replicas, clients)
        specs = {s.name: s for s in parse_fleet({"pods": plan.pods}).pods}
        self.pods: list[_TwinPod] = []
        self.by_row: dict[tuple[str, int], _TwinPod] = {}
        self.gateways = [self._gateway(i, seed, specs) for i in range(replicas)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.sent: list[_Sent | None] = []
        self.open = 0  # requests neither finished nor failed
        self.prefix_hit_share: float | None = None  # of the measured prompts' tokens (run)

    # -- setup ------------------------------------------------------------------------------

    def _gateway(self, index: int, seed: int, specs: dict[str, PodSpec]) -> _Gateway:
        """Replica `index`; the first has the one-gateway twin's random streams (its results
        are the same), the others their own."""
        rand = random.Random(seed if index == 0 else f"twin-replica:{seed}:{index}")
        datastore = Datastore(self.config)
        model_map = ModelMap.from_pools(
            ((s.name, s.model_name, s.lora_adapters) for s in self.config.schedulers),
            created=0)
        rng = np.random.default_rng(seed if index == 0 else [seed, index])
        pools: dict[str, _TwinPool] = {}
        for cfg, plan_pool in zip(self.config.schedulers, self.plan.pools, strict=True):
            pool = datastore.pools[cfg.name]
            scheduler = Scheduler(pool, rng=rng)
            pools[cfg.name] = _TwinPool(pool, scheduler, plan_pool.model,
                                        Admission(pool, scheduler))
            for entry in plan_pool.pods:
                self._add_pod(index, cfg.name, pool, specs[entry["name"]])
        gateway = _Gateway(f"twin-{index}", datastore, model_map, MetricsCollector(datastore),
                           rand, pools, {name: tp.scheduler for name, tp in pools.items()})
        for tp in pools.values():  # as AdmissionQueue listens to its scheduler
            tp.scheduler.add_listener(self._listener(gateway, tp))
        if self.coordination is not None:
            settings = self.coordination
            outbox = Outbox(settings.buffer_size)
            peers = Replicas(gateway.name, settings.replica_timeout_s)
            shares = SharedScrapes(gateway.name, peers, outbox, gateway.collector,
                                   lambda: True, settings.flush_interval_s) \
                if settings.share_scrapes else None
            folder = Folder(cast("Director", gateway), peers, shares)
            gateway.link = _Link(outbox, peers, folder, shares)
        return gateway

    def _add_pod(self, index: int, pool_name: str, pool: Pool, spec: PodSpec) -> None:
        pod = pool.add_pod(spec.name, name=spec.name)
        if index > 0:  # the engines are the first replica's; every replica has the same rows
            assert self.by_row[(pool_name, pod.row)].replay.spec.name == spec.name
            return
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
        for gateway in self.gateways:
            for pod in self.pods:
                spread = min(self._interval_s(), FIRST_SCRAPE_SPREAD_S)
                self._push(gateway.rand.uniform(0.0, spread) * self.scale, "scrape",
                           (gateway, pod))
        if self.coordination is not None:  # started before the traffic: they know each other
            for gateway in self.gateways:
                self._push(0.0, "beat", gateway)
        self.sent = [None] * len(self.plan.requests)
        self.open = len(self.plan.requests)
        before: tuple[int, int, int] | None = None
        first_measured = self.plan.requests[measured_indices(self.plan)[0]].at
        while self.open > 0:
            busy = [p for p in self.pods if p.replay.end is not None]
            next_end = min((p.replay.end for p in busy), default=math.inf)  # type: ignore[type-var]
            if self.events and self.events[0][0] < next_end:
                t, _, kind, payload = heapq.heappop(self.events)
                if before is None and t >= first_measured:
                    before = self._counters()
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
        loads, queries, hits = (a - b for a, b in zip(self._counters(), before or (0, 0, 0),
                                                     strict=True))
        self.prefix_hit_share = hits / queries if queries else None
        label = f"gateway {self.profile}" if len(self.gateways) == 1 else (
            f"gateway {self.profile} x{len(self.gateways)}"
            + (" coordinated" if self.coordination is not None else ""))
        return ReplayResult(label, ttft, [s.pod if s is not None else None for s in self.sent],
                            loads)

    def _counters(self) -> tuple[int, int, int]:
        """Adapter loads, prompt tokens looked up in the pods' prefix caches, and hits."""
        stats = [p.replay.engine.stats for p in self.pods]
        return (adapter_loads(p.replay for p in self.pods),
                sum(s.prefix_queries for s in stats), sum(s.prefix_hits for s in stats))

    def replica_shares(self) -> list[float]:
        """Each replica's share of the measured requests (after `run`)."""
        measured = [self.sent[i] for i in measured_indices(self.plan)]
        counts = [sum(1 for s in measured if s is not None and s.gateway is g)
                  for g in self.gateways]
        return [round(c / max(sum(counts), 1), 3) for c in counts]

    def _push(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, payload))

    def _handle(self, kind: str, payload: Any, t: float) -> None:
        if kind == "arrival":
            self._arrive(payload, t)
        elif kind == "scrape":
            self._scrape(*payload, t)
        elif kind == "look":  # the admission queue's look, soon after a change
            self._look(*payload, t)
        elif kind == "tick":  # the admission queue's periodic re-check
            self._tick(*payload, t)
        elif kind == "timeout":
            self._timeout(*payload, t)
        elif kind == "flush":
            self._scheduled_flush(payload, t)
        elif kind == "deliver":
            self._deliver(*payload, t)
        else:  # "beat"
            self._beat(payload, t)

    def _interval_s(self) -> float:
        return INTERVAL_S / self.scale

    # -- requests ---------------------------------------------------------------------------

    def _arrive(self, position: int, t: float) -> None:
        gateway = self.gateways[self.front.acquire(position, t)]
        spec = self.plan.requests[position]
        parsed = parse_request(spec.body, CHAT_PATH, "application/json", None,
                               self.config.bbr.max_request_body_bytes)
        route = gateway.model_map.resolve(parsed.model)
        request = SchedulingRequest(
            model=parsed.model, adapter=route.adapter, prompt_tokens=parsed.prompt_tokens,
            max_tokens=parsed.max_tokens,
            prefix_hashes=prefix_hashes(parsed.model, parsed.prompt, MAX_PREFIX_BLOCKS))
        sent = _Sent(position, t, orjson.loads(spec.body), spec.model, route.pool, request,
                     gateway)
        self.sent[position] = sent
        tp = gateway.pools[route.pool]
        try:
            wait = tp.admission.must_wait(request, t / self.scale)
        except Overloaded:  # a sheddable request finding no room (none in the plans)
            self._end(sent, t)
            return
        if wait:
            self._hold(gateway, tp, sent, t)
        else:
            self._dispatch(gateway, tp, sent, t)

    def _dispatch(self, gateway: _Gateway, tp: _TwinPool, sent: _Sent, t: float) -> None:
        now = t / self.scale
        if self.observe is not None:
            self.observe(self, tp, sent, t)
        try:
            pick = tp.scheduler.pick(sent.request, now)
        except NoCandidates:
            self._end(sent, t)
            return
        row = int(pick.rows[0])
        tp.scheduler.on_dispatch(row, sent.request, now, pick.cached)
        link = gateway.link
        if link is not None:  # the director's outbox.dispatched
            sent.shared_id = link.outbox.dispatched(tp.pool.name, tp.pool.row_address[row],
                                                    sent.request, pick.cached)
            self._outbox_event(gateway, t)
        pod = self.by_row[(tp.pool.name, row)]
        sim, _ = build_request(sent.body, sent.spec_model, tp.base_model, True)
        sent.row, sent.pod = row, pod.replay.spec.name
        try:
            pod.replay.add(sim, t)
        except (QueueFull, PromptTooLong):
            self._complete(gateway, tp, sent, t, ok=False)
            self._end(sent, t)
            return
        sent.sim = sim
        pod.pending.append(sent)

    def _complete(self, gateway: _Gateway, tp: _TwinPool, sent: _Sent, t: float,
                  ok: bool) -> None:
        """The director's `complete`: release the request's accounting (and say so to the
        other replicas when coordinated)."""
        now = t / self.scale
        duration = now - sent.arrival / self.scale
        tp.scheduler.on_complete(sent.row, sent.request, now, duration,
                                 ok, address=tp.pool.row_address[sent.row])
        if gateway.link is not None:
            gateway.link.outbox.completed(sent.shared_id, duration if ok else None)
            self._outbox_event(gateway, t)

    def _completions(self, pod: _TwinPod, t: float) -> None:
        """The requests that ended in the iteration just run: each replica's `complete`."""
        done = sum(pod.replay.engine.stats.success.values())
        if done == pod.finished_seen:
            return
        pod.finished_seen = done
        keep = []
        for sent in pod.pending:
            if sent.sim is not None and sent.sim.finished:
                gateway = sent.gateway
                self._complete(gateway, gateway.pools[pod.pool], sent, t, ok=True)
                self._end(sent, t)
            else:
                keep.append(sent)
        pod.pending = keep

    def _end(self, sent: _Sent, t: float) -> None:
        """The request is over (finished or failed): its client's connection is idle."""
        self.open -= 1
        self.front.release(sent.position, self.gateways.index(sent.gateway), t)

    # -- admission --------------------------------------------------------------------------

    def _hold(self, gateway: _Gateway, tp: _TwinPool, sent: _Sent, t: float) -> None:
        """AdmissionQueue.acquire for a request that must wait: queued (a full queue
        refuses it or the waiter it displaces), the ticker started, a look due, and its
        timeout set. (Live, acquire asks `must_wait` again after a hop through the
        handler; here no time passes in between, so the answer is the same.)"""
        try:
            victim = tp.admission.hold(sent)
        except Overloaded:
            self._end(sent, t)
            return
        if victim is not None:
            self._end(victim, t)
        if not tp.ticking:
            tp.ticking = True
            self._push(t + RECHECK_INTERVAL_S * self.scale, "tick", (gateway, tp))
        self._notify(gateway, tp, t)
        timeout = tp.pool.config.saturation.queue_timeout_s * self.scale
        self._push(t + timeout, "timeout", (tp, sent))

    def _listener(self, gateway: _Gateway, tp: _TwinPool) -> Callable[[], None]:
        """The scheduler's dispatch/complete listener (AdmissionQueue.notify)."""
        return lambda: self._notify(gateway, tp, self.clock.t)

    def _notify(self, gateway: _Gateway, tp: _TwinPool, t: float) -> None:
        """A look at the queue soon (call_soon: at t, after what is already due), unless
        nobody waits or one is due already."""
        if len(tp.admission) and not tp.look_due:
            tp.look_due = True
            self._push(t, "look", (gateway, tp))

    def _look(self, gateway: _Gateway, tp: _TwinPool, t: float) -> None:
        """AdmissionQueue._release: the next waiter out if the pool has room for it; its
        dispatch (a listener call) asks for the next look."""
        tp.look_due = False
        if not len(tp.admission):
            return
        sent = tp.admission.release(t / self.scale)
        if sent is not None:
            self._dispatch(gateway, tp, sent, t)

    def _tick(self, gateway: _Gateway, tp: _TwinPool, t: float) -> None:
        """AdmissionQueue._recheck: a look every RECHECK_INTERVAL_S while anyone waits
        (scrapes change room too, and they notify no one)."""
        self._look(gateway, tp, t)
        if len(tp.admission):
            self._push(t + RECHECK_INTERVAL_S * self.scale, "tick", (gateway, tp))
        else:
            tp.ticking = False

    def _timeout(self, tp: _TwinPool, sent: _Sent, t: float) -> None:
        """The waiter's queueTimeout: still queued, it leaves and fails (503 live)."""
        if sent.entry is not None and not sent.entry.removed:
            tp.admission.withdraw(sent)
            self._end(sent, t)

    # -- scrapes ----------------------------------------------------------------------------

    def _scrape(self, gateway: _Gateway, pod: _TwinPod, t: float) -> None:
        """The collector's pod loop: `scrape_once` on the pod's page as the simulator writes
        it, unless shared scrape results say another replica's fresh ones cover the pod."""
        pool = gateway.pools[pod.pool].pool
        now = t / self.scale
        shares = gateway.link.shares if gateway.link is not None else None
        failures = 0
        if shares is None or shares.should_scrape(pool, pool.pods[pod.replay.spec.name], now):
            body = metrics_text.render(pod.replay.engine, pod.kind, pod.options, now=t)
            snapshot: MetricsSnapshot | None = None
            error = ""
            try:
                snapshot = parser_for(profile_for(pool.config.engine_type)).parse(body.decode())
            except MetricsParseError as exc:
                pool.mark_scrape(pod.row, False, now=now)
                failures, error = 1, f"{type(exc).__name__}: {exc}"[:200]
            else:
                write_snapshot(pool, pod.row, snapshot, gateway.collector.learner, now)
            if shares is not None:
                shares.scraped(pool, pool.pods[pod.replay.spec.name], snapshot, error, now)
                self._outbox_event(gateway, t)
        if self.open > 0:
            delay = next_delay(pool.config.metrics, failures, gateway.collector.options,
                               gateway.rand)
            self._push(t + delay * self.scale, "scrape", (gateway, pod))

    # -- coordination -----------------------------------------------------------------------

    def _outbox_event(self, gateway: _Gateway, t: float) -> None:
        """Something entered the outbox: schedule the flush when Coordinator._gather lets
        the batch leave: with a dispatch, `flushInterval` after the last batch with one;
        without, `flushInterval` after the last batch; at once if that is past. A dispatch
        entering a batch of completions or scrapes moves its flush earlier, never later."""
        link = gateway.link
        assert link is not None and self.coordination is not None
        if not len(link.outbox):
            return
        last = link.dispatched_at if link.outbox.dispatch_ready.is_set() else link.flushed_at
        due = max(t, last + self.coordination.flush_interval_s * self.scale)
        if link.due_at <= due:
            return
        link.due_at = due
        self._push(due, "flush", gateway)

    def _scheduled_flush(self, gateway: _Gateway, t: float) -> None:
        """A scheduled flush, unless an earlier one replaced it."""
        link = gateway.link
        assert link is not None
        if t == link.due_at:
            self._flush(gateway, t)

    def _flush(self, gateway: _Gateway, t: float, beat: bool = False) -> None:
        """Coordinator._flush: the batch's entries, encoded, reach every other replica
        one Redis hop later."""
        link = gateway.link
        assert link is not None
        now = t / self.scale
        if not beat:
            link.due_at = math.inf
        dispatches = link.outbox.dispatch_ready.is_set()
        events = link.outbox.take()
        scrapes = link.outbox.take_scrapes(now)
        if events or scrapes:
            link.flushed_at = t
            if dispatches:
                link.dispatched_at = t
        if not events and not scrapes and not beat:
            return
        entries = encode_batches(events, link.seq, now, scrapes=scrapes,
                                 shares_scrapes=link.shares is not None)
        link.seq += len(entries)
        for other in self.gateways:
            if other is not gateway:
                self._push(t + self.rtt_s * self.scale, "deliver", (other, gateway.name, entries))

    def _deliver(self, gateway: _Gateway, sender: str, entries: list[dict[bytes, bytes]],
                 t: float) -> None:
        """The read loop: decode and fold each entry, aged by its transit; the fold moves
        the schedulers' counts, whose listeners ask the admission queues for a look."""
        link = gateway.link
        assert link is not None
        now = t / self.scale
        for fields in entries:
            batch = decode_batch(fields)
            link.folder.fold(sender, batch, now, max(0.0, now - batch.sent_at))

    def _beat(self, gateway: _Gateway, t: float) -> None:
        """Every heartbeatInterval: a heartbeat entry unless a batch is about to leave (it
        says as much), and the sweep of silent peers."""
        link = gateway.link
        assert link is not None and self.coordination is not None
        if link.due_at == math.inf:
            self._flush(gateway, t, beat=True)
        link.replicas.sweep(t / self.scale)
        if self.open > 0:
            self._push(t + self.coordination.heartbeat_interval_s * self.scale, "beat", gateway)


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


# Live routers that are "another router" for the ranking: the open routers a user would try
# instead of this gateway (bench/routers.py, kinds sglang and vllm).
OPEN_ROUTER_KINDS = ("sglang", "vllm")
# The replay's stand-ins for them in the twin's ranking: load- and adapter-aware policies that,
# like them, know nothing of a pod's speed (best-ttft, the other yardstick, knows everything).
OTHER_YARDSTICKS = ("least-work", "adapter-affine")


def live_check(names: list[str], seed: int, results: Path,
               family: int | None = None) -> list[dict[str, Any]]:
    """The twin against the live runs in `results`/<name>.json: each hand-written scenario's
    plan with the live run's warm-up (the plan of seed + 1000, 3 s wall, bench/cli.py) and,
    with `family`, the family sample `igw bench --family K --live` runs (bench.family.sample,
    each member with its own warm-up). One row per scenario (`check_row`); printed, and
    returned for `family-live.json`."""
    from bench.family import sample, warm_started
    from bench.scenarios import SCENARIOS

    cases: list[tuple[str, Path, Any]] = [(name, results / f"{name}.json", None)
                                          for name in names]
    if family:
        cases += [(m.scenario, results / f"{m.scenario}.json", m) for m in sample(seed, family)]
    rows = []
    for name, path, member in cases:
        if not path.exists():
            continue
        doc = orjson.loads(path.read_bytes())
        live = {s["router"]: s for s in doc["summaries"] if s.get("ttft_p95") is not None}
        if "igw-llm-d" not in live:
            continue
        if member is None:
            scale = doc["time_scale"]
            plan = SCENARIOS[name].plan(seed, doc["duration_model_s"] / scale, scale)
            plan = warm_started(plan, SCENARIOS[name].plan(seed + 1000, 3.0, scale), scale)
        else:
            plan = member
        row = check_row(name, plan, live, seed)
        rows.append(row)
        print(_check_line(row), flush=True)
    return rows


def check_row(name: str, plan: Plan, live: dict[str, dict[str, Any]],
              seed: int) -> dict[str, Any]:
    """One scenario's twin against its live run (`live`: the run's summaries by router name,
    `igw-llm-d` among them): the twin's p95 over the live gateway's (can the twin stand in
    for it?), and the two rankings side by side, each on the same side of 1 or not:
    - against round-robin: the twin's over the replay's strict rotation, live's over Envoy's;
    - against another router: live, the best open router that ran (sglang-router,
      vllm-router); in the twin, the best of the replay's `OTHER_YARDSTICKS`. Not the same
      policies, so the check is whether the gateway stands on the same side of the best
      simple alternative, not a figure the twin predicts."""
    from bench.replay import replay_reference
    from bench.routers import ROUTERS

    measured = measured_indices(plan)
    result = twin(plan, seed=seed)
    figs = result.percentiles(measured)
    refs = replay_reference(plan, ("round-robin", *OTHER_YARDSTICKS))
    ours = live["igw-llm-d"]
    row: dict[str, Any] = {
        "scenario": name, "twin": figs,
        "live": {k: ours[k] for k in ("ttft_p50", "ttft_p95", "ttft_p99")},
        "live_p95": {k: v["ttft_p95"] for k, v in live.items()},
        "failed": {"twin": sum(result.ttft_s[i] is None for i in measured),
                   "live": ours.get("errors", 0)},
        "p95_ratio": round(figs["ttft_p95"] / ours["ttft_p95"], 3),
        "twin_vs_round_robin": _over(figs["ttft_p95"], refs["round-robin"]["ttft_p95"]),
        "live_vs_envoy_rr": _over(ours["ttft_p95"], live.get("envoy-rr", {}).get("ttft_p95"))}
    other = min(OTHER_YARDSTICKS, key=lambda k: refs[k]["ttft_p95"])
    row["twin_other"] = other
    row["twin_vs_other"] = _over(figs["ttft_p95"], refs[other]["ttft_p95"])
    open_routers = {k: v for k, v in live.items()
                    if k in ROUTERS and ROUTERS[k].kind in OPEN_ROUTER_KINDS}
    if open_routers:
        best = min(open_routers, key=lambda k: open_routers[k]["ttft_p95"])
        row["live_open_router"] = best
        row["live_vs_open_router"] = _over(ours["ttft_p95"], open_routers[best]["ttft_p95"])
    row["agrees"] = {key: _same_side(row.get(t), row.get(lv)) for key, t, lv in (
        ("round_robin", "twin_vs_round_robin", "live_vs_envoy_rr"),
        ("other", "twin_vs_other", "live_vs_open_router"))}
    return row


def _over(value: float, reference: float | None) -> float | None:
    return round(value / reference, 3) if reference else None


def _same_side(twin_ratio: float | None, live_ratio: float | None) -> bool | None:
    """Both ratios below 1 or both at or above it; None where one is missing."""
    if twin_ratio is None or live_ratio is None:
        return None
    return (twin_ratio < 1.0) == (live_ratio < 1.0)


def _check_line(row: dict[str, Any]) -> str:
    twin_figs, live_figs = row["twin"], row["live"]
    line = (f"{row['scenario']}: twin p50/p95/p99 {twin_figs['ttft_p50']}/{twin_figs['ttft_p95']}/"
            f"{twin_figs['ttft_p99']} s, live {live_figs['ttft_p50']}/{live_figs['ttft_p95']}/"
            f"{live_figs['ttft_p99']} s, p95 twin/live {row['p95_ratio']}; over round-robin "
            f"twin {row['twin_vs_round_robin']}, live {row['live_vs_envoy_rr']}; over "
            f"{row['twin_other']} twin {row['twin_vs_other']}")
    if "live_open_router" in row:
        line += f", over {row['live_open_router']} live {row['live_vs_open_router']}"
    return (line + f"; failed twin {row['failed']['twin']}, live {row['failed']['live']}")
