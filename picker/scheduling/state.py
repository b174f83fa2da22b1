"""The scheduler's own per-pool bookkeeping: what the gateway sent and what it learned.

The datastore's columns hold what the scrapes say plus the gateway's counters
(`inflight`, `dispatched`, ...). This object updates those counters on
dispatch and completion ("work, not counts": prompt and output tokens, not
only requests) and keeps what the datastore has no column for: the prefix
index, prompt tokens dispatched since each pod's last scrape, observed seconds
per token and per output token (EWMAs per pod), and pool-wide mean request sizes.
It survives config reloads; rows whose pod changed are wiped.
"""

from __future__ import annotations

import math

import numpy as np

from picker.datastore import MAX_ADAPTERS, SPEED_STALE_S, Pool
from picker.scheduling.prefix_demand import PrefixDemand
from picker.scheduling.prefix_footprint import PrefixFootprint
from picker.scheduling.prefix_index import DEFAULT_BLOCKS_PER_POD, PrefixIndex
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.shares import TenantShares

POD_EWMA_ALPHA = 0.2
POOL_EWMA_ALPHA = 0.05
# Used until a pool has learned anything: deliberately slow, so a pod with
# unknown speed is never preferred for being "fast".
DEFAULT_PREFILL_TPS = 1000.0
# A finished request's sample counts for at most this many times the current floor.
FLOOR_GROWTH = 2.0
DEFAULT_DECODE_STEP_S = 0.03
DEFAULT_PROMPT_TOKENS = 512.0
DEFAULT_OUTPUT_TOKENS = 256.0
MAX_OUTPUT_TOKENS_ESTIMATE = 8192.0
SPEED_REFRESH_S = 0.2
# Learned prefill speeds within this ratio of each other are one speed class
# (see `speed_classes`).
SPEED_CLASS_RATIO = 1.5
# Each row's most recent sends (time and prompt tokens) kept for `scrape_dated`: a shared
# scrape is ~flushInterval old when it arrives, and more than this many sends to one pod
# inside that window would be a burst the oldest of which the scrape has seen anyway.
RECENT_SENDS = 32
_RING = np.arange(RECENT_SENDS)
# Pods whose KV caches hold this close to the same number of tokens count as the same
# hardware for an untried pod's first guess (`probe_speeds`).
TWIN_CAPACITY = 0.01
# An adapter-slot probe (`probe_capacity`) with no verdict by then is dropped (one may follow).
SLOT_PROBE_TIMEOUT_S = 10.0
# No such guess before this share of a pool's pods has a known speed (`_probe_guess`).
PROBE_AFTER_KNOWN = 0.25
# A learned speed with no new observation for SPEED_STALE_S is not trusted: the pod
# may have recovered from whatever made it slow, so it is retried at the pool median
# (picker.datalayer.speed re-learns it from that request), but at most once per
# STALE_RETRY_EVERY of the pool's requests (`may_retry_stale`): 2 %, under the 5 % a
# p95 leaves.
STALE_RETRY_EVERY = 50

# (prefill tokens/s, decode step s) per table row.
_Speeds = tuple[np.ndarray, np.ndarray]
# `_speed` and `_probe` held to stale rows' last learned speeds (`cautious_speeds`).
_Cautious = tuple[_Speeds, _Speeds | None]


class PoolState:
    """Gateway-side state for one pool, row-aligned with `pool.table`."""

    def __init__(self, pool: Pool, blocks_per_pod: int = DEFAULT_BLOCKS_PER_POD) -> None:
        self.pool = pool
        self.prefix = PrefixIndex(blocks_per_pod)
        self.footprint = PrefixFootprint()
        self.demand = PrefixDemand()
        self.mean_prompt = 0.0
        self.mean_output = 0.0
        # Prefix affinity outcome, for the gateway's metrics: prompt blocks asked
        # about, and how many of them the chosen pod already had.
        self.prefix_query_blocks = 0
        self.prefix_hit_blocks = 0
        self._version = -1
        self._owners: list[str | None] = []
        # Prompt tokens sent since each row's last scrape, less requests that ended
        # before any scrape saw them (they never reach `waiting`). The backlog's
        # `sent_tokens - fold_sent` counts the same sends but keeps those: the engine's
        # prompt counter includes them, so the next fold must too. Not one counter.
        self.since_tokens = np.zeros(0)
        self.since_stamp = np.zeros(0)
        # The same sends' tokens the pod has to compute: each prompt less the part the
        # prefix index expected cached at its dispatch.
        self.since_uncached = np.zeros(0)
        # The gateway's pace of each row (`observed_pace`): seconds per output token
        # (`spot`), the ratio of EWMAs of finished requests' seconds and output tokens
        # (`_pace`); 0 until one finished.
        self.spot = np.zeros(0)
        self.paced_seconds = np.zeros(0)
        self.paced_output = np.zeros(0)
        # A floor under each row's prefill speed from what the gateway saw finish: a
        # request's prefill is done before it ends, so its uncached prompt over its
        # duration is at most the speed (EWMA of those; 0 until one ended). For flow
        # control, on pods whose engine exports no speed (picker.scheduling.flow).
        self.prefill_floor = np.zeros(0)
        # Prefill backlog (see `prefill_backlog`): prompt tokens sent to each row in
        # total, those not yet prefilled as of the last folded scrape, and that
        # scrape's time, sent total and engine prompt-token counter.
        self.sent_tokens = np.zeros(0)
        self.backlog = np.zeros(0)
        # The backlog in tokens to compute (`_latest_uncached`), set at each fold.
        self.backlog_uncached = np.zeros(0)
        self.fold_stamp = np.zeros(0)
        self.fold_sent = np.zeros(0)
        self.fold_counter = np.zeros(0)
        # EWMA of the prompt fraction each row was expected to have cached: the backlog
        # counts whole prompts (as the engine's counter does), its work is the rest.
        self.cached_share = np.zeros(0)
        # Where the page has no prefill clock (SGLang, TensorRT-LLM: no prompt counter that
        # grows as prefills end), when each row would be through the uncached prompts the
        # gateway sent it, at its learned uncached speed, if it did nothing but prefill them
        # (`blind_prefill`); 0 until a send with a learned speed.
        self.prefill_due = np.zeros(0)
        # When the gateway last sent each adapter to each pod: engines keep recently
        # used adapters resident, but vLLM's metrics only show adapters of *running*
        # requests, so an idle resident adapter is visible only from here.
        self.adapter_sent = np.zeros((0, MAX_ADAPTERS))
        # Requests of each adapter in flight on each pod (every replica's): what holds an
        # adapter slot where the engine does not say (SGLang, TensorRT-LLM publish no
        # adapter metrics), filters.lora_state.
        self.adapter_inflight = np.zeros((0, MAX_ADAPTERS))
        # The same for this replica's requests only: their completions are known at once,
        # another replica's a flush late (`_learn_adapter_slots`).
        self.adapter_local = np.zeros((0, MAX_ADAPTERS))
        # There, the most adapters the pool's pods were seen running at once, the same in
        # every row (`_learn_adapter_slots`); a replaced pod's row is 0 until the next scrape.
        self.adapter_slots = np.zeros(0)
        # One adapter beyond the proved slots sent to a pod at a time (`probe_capacity`):
        # when (0: none out), where, with how many adapters in flight there, which adapter;
        # and the slots a probe disproved (its scrape showed a queue): never probed again.
        self.probe_at = 0.0
        self.probe_row = -1
        self.probe_level = 0.0
        self.probe_slot = -1
        self.slot_cap = math.inf
        # Each row's last RECENT_SENDS dispatches of this replica: when, their prompt
        # tokens and the part of those not expected cached; `recent_next` is the ring's
        # next slot. Read by `scrape_dated` and by the backlog's fold (`_latest_uncached`).
        self.recent_at = np.zeros((0, RECENT_SENDS))
        self.recent_tokens = np.zeros((0, RECENT_SENDS))
        self.recent_uncached = np.zeros((0, RECENT_SENDS))
        self.recent_next = np.zeros(0)
        # Each row's learned batch slots (concurrent requests the engine runs), 0 while
        # unknown: see `slot_limits`. And this replica's requests per tenant (fair shares).
        self.slots = np.zeros(0)
        # The last scrape `slot_limits` looked at per row, its `running` if it showed a
        # queue with KV to spare (else -1), and its step counter: two such in a row with
        # an engine step between them teach the slots.
        self.slot_stamp = np.zeros(0)
        self.slot_running = np.zeros(0)
        self.slot_steps = np.zeros(0)
        self.shares = TenantShares()
        self._speed_at = -math.inf
        self._speed_version = -1
        self._speed: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
        # Each row's learned uncached prefill speed where its page has no prefill clock, else
        # 0; rebuilt with `_speed` (`blind_prefill`).
        self._blind_tps = np.zeros(0)
        # The pool's median uncached speed over counted speed (1: nothing cached or not
        # learned), rebuilt with `_speed` (`uncached_speed_ratio`).
        self._uncached_ratio = 1.0
        # Each row's own uncached prefill speed where its engine counts cache hits and it is
        # learned, else 0; rebuilt with `_speed` (`fresh_speeds`).
        self._own_uncached = np.zeros(0)
        # What an untried idle pod is given per row (`probe_speeds`), rebuilt with `_speed`;
        # None while no pod's speed is known.
        self._probe: tuple[np.ndarray, np.ndarray] | None = None
        # `_speed` and `_probe` held to the stale rows' last learned speeds where slower
        # (None: no row stale), and the pool's requests dispatched, before which no stale
        # pod is retried (`cautious_speeds`).
        self._cautious: _Cautious | None = None
        self._dispatches = 0
        self._retry_after = 0
        # The smallest KV cache (tokens) among the pool's pods that publish one, else 0;
        # rebuilt with `_speed` (`smallest_cache`).
        self._smallest_cache = 0.0
        # Every pod publishes its KV cache size and they agree within TWIN_CAPACITY; rebuilt
        # with `_speed` (`one_cache_size`).
        self._one_cache_size = False
        self.sync()

    # -- keeping rows aligned with the datastore ---------------------------------

    def sync(self) -> None:
        """Follow pool growth and row reuse (cheap no-op unless membership changed)."""
        pool = self.pool
        cap = pool.table.capacity
        if pool.version == self._version and len(self.spot) == cap:
            return
        if len(self.spot) < cap:
            for name in _ROW_ARRAYS:
                grown = np.zeros(cap)
                old = getattr(self, name)
                grown[: len(old)] = old
                setattr(self, name, grown)
            for name, width in _ROW_MATRICES:
                grown = np.zeros((cap, width))
                old = getattr(self, name)
                grown[: len(old)] = old
                setattr(self, name, grown)
            self._owners.extend([None] * (cap - len(self._owners)))
        for row, address in enumerate(pool.row_address):
            if self._owners[row] != address:
                self._reset_row(row)
                self._owners[row] = address
        self._version = pool.version

    def _reset_row(self, row: int) -> None:
        self.prefix.forget(row)
        for name in _ROW_ARRAYS:
            getattr(self, name)[row] = 0.0
        for name, _ in _ROW_MATRICES:
            getattr(self, name)[row] = 0.0

    def set_blocks_per_pod(self, blocks: int) -> None:
        """Resize the prefix LRUs on reload; shrinking evicts on the next insert."""
        self.prefix.blocks_per_pod = blocks

    # -- accounting ---------------------------------------------------------------

    def on_dispatch(
        self,
        row: int,
        req: SchedulingRequest,
        now: float,
        cached: float = 0.0,
        *,
        remote: bool = False,
    ) -> None:
        """Count the request against `row` at once, before any scrape can see it.

        `remote`: another gateway replica sent it (picker.coordination): the same
        columns count it, except `picks`, which says what this replica chose; its
        tenant counts in the fair shares as active and in flight, so a tenant's share
        of the pool's slots holds across the replicas.
        """
        self.sync()
        self.slot_limits(slice(row, row + 1))  # a scrape's queue is read while it lasts
        t = self.pool.table
        prompt = float(max(req.prompt_tokens, 0))
        output = float(max(req.max_tokens, 0))
        t.inflight[row] += 1.0
        t.dispatched[row] += 1.0
        self._dispatches += 1
        if _stale(t.speed_seen_at[row], now):  # a stale pod retried: the next waits
            self._retry_after = self._dispatches + STALE_RETRY_EVERY
        if remote:
            if req.tenant:  # an older replica's, or tenants off: no tenant to count
                self.shares.seen(req.tenant, req.tenant_weight, now,
                                 self.pool.config.saturation.fair_share_window_s)
        else:
            t.picks[row] += 1.0
        self.shares.dispatched(req.tenant)
        t.outstanding_prefill[row] += prompt
        t.outstanding_decode[row] += output
        t.last_picked_at[row] = now
        if self.fold_stamp[row] != t.scraped_at[row]:
            self.prefill_backlog()  # fold that scrape before counting tokens it cannot show
        self.sent_tokens[row] += prompt
        self.cached_share[row] = _ewma_share(self.cached_share[row], cached)
        speed = self._blind_tps[row] if row < len(self._blind_tps) else 0.0
        if speed > 0:
            due = max(float(self.prefill_due[row]), now)
            self.prefill_due[row] = due + prompt * (1.0 - cached) / speed
        if self.since_stamp[row] != t.scraped_at[row]:
            self.since_stamp[row] = t.scraped_at[row]
            self.since_tokens[row] = 0.0
            self.since_uncached[row] = 0.0
        self.since_tokens[row] += prompt
        self.since_uncached[row] += prompt * (1.0 - cached)
        if not remote:  # a folded send's own time is not known here (`scrape_dated`)
            slot = int(self.recent_next[row]) % RECENT_SENDS
            self.recent_at[row, slot] = now
            self.recent_tokens[row, slot] = prompt
            self.recent_uncached[row, slot] = prompt * (1.0 - cached)
            self.recent_next[row] = slot + 1
        self.mean_prompt = _ewma(self.mean_prompt, prompt, POOL_EWMA_ALPHA)
        if output > 0:
            est = min(output, MAX_OUTPUT_TOKENS_ESTIMATE)
            self.mean_output = _ewma(self.mean_output, est, POOL_EWMA_ALPHA)
        blocks = len(req.prefix_hashes)
        if blocks:
            hashes = req.prefix_hashes.tolist()
            shared = self.prefix.insert(row, hashes)
            self.footprint.record(hashes[0], round(prompt * shared / blocks), now)
        self.demand.record(hashes[0] if blocks else None, now)
        if req.adapter is not None:
            slot = self.pool.adapter_index.get(req.adapter)
            if slot is not None:
                self._note_probe(row, slot, now)
                self.adapter_sent[row, slot] = now
                self.adapter_inflight[row, slot] += 1.0
                if not remote:
                    self.adapter_local[row, slot] += 1.0

    def on_complete(
        self,
        row: int,
        req: SchedulingRequest,
        duration_s: float,
        ok: bool,
        output_tokens: int | None = None,
        now: float | None = None,
        *,
        remote: bool = False,
        origin_duration_s: float | None = None,
    ) -> None:
        """Release the request's work; learn the pod's observed speed from a success.

        A request that ended before any scrape saw it is taken out of the
        since-scrape counts too: it will never show up in `waiting`, and left
        there it would make the pod look busier than it is until the next scrape.
        `remote` (another replica's request): its work is released, and the speed
        sample is the origin's measured duration (`origin_duration_s`), never
        this replica's `duration_s`, which only says when the completion reached
        it. Without the origin's measure nothing is learned. Every replica then
        learns from all the pod's traffic: with N replicas, learning from its own
        share only, a replica's speeds lagged N times behind (measured: a mixed
        SGLang fleet at 90 % load, +24 % TTFT p95 at N = 4 in the twin).
        """
        self.sync()
        self.slot_limits(slice(row, row + 1))  # a scrape's queue is read while it lasts
        t = self.pool.table
        t.inflight[row] = max(0.0, t.inflight[row] - 1.0)
        if req.adapter is not None:
            slot = self.pool.adapter_index.get(req.adapter)
            if slot is not None:
                self.adapter_inflight[row, slot] = max(0.0, self.adapter_inflight[row, slot] - 1.0)
                if not remote:
                    self.adapter_local[row, slot] = max(0.0, self.adapter_local[row, slot] - 1.0)
        self.shares.completed(req.tenant)
        if now is not None and t.scraped_at[row] < now - duration_s:
            t.dispatched[row] = max(0.0, t.dispatched[row] - 1.0)
            if self.since_stamp[row] == t.scraped_at[row]:
                # its uncached part is not kept per request: the rest keeps its share
                left = max(0.0, self.since_tokens[row] - req.prompt_tokens)
                kept = left / self.since_tokens[row] if self.since_tokens[row] > 0 else 0.0
                self.since_tokens[row] = left
                self.since_uncached[row] *= kept
        t.outstanding_prefill[row] = max(0.0, t.outstanding_prefill[row] - req.prompt_tokens)
        t.outstanding_decode[row] = max(0.0, t.outstanding_decode[row] - req.max_tokens)
        out = req.max_tokens if output_tokens is None else output_tokens
        tokens = max(req.prompt_tokens, 0) + max(out, 0)
        sample_s = origin_duration_s if remote else duration_s
        if ok and sample_s is not None and tokens > 0 and sample_s > 0:
            paced = out if out > 0 else tokens  # nothing generated (embeddings): the prompt
            self._pace(row, sample_s, paced)
            self._learn_floor(row, req, sample_s)

    def _pace(self, row: int, seconds: float, output: float) -> None:
        """Fold one finished request into the row's pace: EWMAs of its seconds and its
        output tokens; `spot` is their ratio.

        Ratios of averages, not averages of ratios: a request's seconds per token swing
        with its mix (a long cached prompt and a short answer read 10x faster per token
        than a short prompt and a long answer on the same pod), and a mean of per-request
        ratios weighs a 20-token request as much as a 2,000-token one. Eight alike H100s
        (TensorRT-LLM, paced) read 3.8-16.8 ms per token that way and split into three
        speed classes; as ratios of averages they read 3.8-12.9 and stay one. Family,
        median of the twin seeds: p95 geometric mean 0.991 / 0.998 / 0.991 on seeds 0-2,
        seed 0's worst member 2.48 -> 1.87x best-ttft (docs/benchmarks.md)."""
        self.paced_seconds[row] = _ewma(self.paced_seconds[row], seconds, POD_EWMA_ALPHA)
        self.paced_output[row] = _ewma(self.paced_output[row], output, POD_EWMA_ALPHA)
        self.spot[row] = self.paced_seconds[row] / self.paced_output[row]

    def _learn_floor(self, row: int, req: SchedulingRequest, duration_s: float) -> None:
        """One finished request's proof of speed, uncached prompt over duration, folded
        into the row's floor; a sample counts for at most twice the floor (or the
        default speed), so the floor grows at most 1.2x per request. The gateway does not
        see a response's status (no response phase), so a request an engine refused at
        once (a 400 for a prompt too long, a 500) looks like a fast one: the cap keeps a
        few of those from lifting the floor far; sustained fast answers, a fast pod,
        still lift it within tens of requests."""
        uncached = max(req.prompt_tokens, 0) * (1.0 - self.cached_share[row])
        floor = self.prefill_floor[row]
        sample = min(uncached / duration_s, FLOOR_GROWTH * max(floor, DEFAULT_PREFILL_TPS))
        self.prefill_floor[row] = _ewma(floor, sample, POD_EWMA_ALPHA)

    # -- derived signals ------------------------------------------------------------

    def slot_limits(self, index: slice | np.ndarray) -> np.ndarray:
        """Learned batch slots of rows `index` (0: unknown), updated from their scrapes.

        No engine exports its slot limit, but while requests wait (`waiting` >= 1)
        with KV cache to spare (below `kvCacheThreshold`: the wait is not for memory)
        the engine runs as many as it may, so `running` is the limit. Not from one
        scrape: arrivals wait for the engine's next step with slots free, so in a
        burst `running` climbs step by step under a queue (seen on the simulator: 2
        running and 1 waiting, one scrape before the pod's 4 slots were full). So a
        limit is learned when two successive scrapes both show a queue with the same
        `running` (read on each dispatch and completion on the pod and every room
        check, so a queue that lasts two scrapes is seen) and the engine ran a step
        between them (`engine_steps` moved; where the page has no step counter, as
        before). A queue within one step is a wait for the step's token budget, not
        for a slot: the next step admits it. A step that prefills a full budget lasts
        longer than a scrape interval (8,192 tokens, ~0.4 s on an L40S for a 3B
        model), so two scrapes saw the same `running` under such a queue and learned
        running as the limit: the scenario family's TensorRT-LLM and vLLM pools got
        6-70 "slots" of 256, and the pool bound held the excess in the gateway's
        queue (family-0-6: 0.5 s mean wait there, TTFT p95 1.47x round-robin's;
        docs/benchmarks.md). Once known, any higher
        `running` raises it, never lower; flow control lets `slotAllowance` per pod
        more in, so an underestimate climbs back to the truth.

        A queue that may be waiting for an *adapter* slot teaches nothing (`_adapter_bound`):
        with few adapter slots, requests of an adapter not loaded wait while the batch
        has room, and `running` there is no batch limit. Learned from such queues, the
        scenario family's LoRA pools got 4-27 "slots" on pods of 256, and the pool bound
        held requests the engines had room for (docs/benchmarks.md).
        """
        t = self.pool.table
        fresh = t.scraped_at[index] != self.slot_stamp[index]
        if not fresh.any():
            return self.slots[index]  # nothing scraped since the last look: nothing to learn
        known = self.slots[index]
        running = t.running[index]
        limited = (t.waiting[index] >= 1.0) & (
            t.kv_usage[index] < self.pool.config.saturation.kv_cache_threshold)
        if self.pool.config.lora_adapters:
            limited &= ~self._adapter_bound(index)
            self._learn_adapter_slots(index, fresh)
        steps = t.engine_steps[index]
        stepped = (steps != self.slot_steps[index]) | np.isnan(steps)
        steady = fresh & limited & stepped & (self.slot_running[index] == running)
        learned = np.where(steady | (known > 0), np.maximum(known, running), known)
        self.slots[index] = learned
        self.slot_running[index] = np.where(
            fresh, np.where(limited, running, -1.0), self.slot_running[index])
        self.slot_steps[index] = steps
        self.slot_stamp[index] = t.scraped_at[index]
        return learned

    def _learn_adapter_slots(self, index: slice | np.ndarray, fresh: np.ndarray) -> None:
        """A lower bound on the pool's adapter slots where the engine publishes none
        (filters.lora_state): a scrape with nothing waiting means every adapter with
        requests in flight there was running at once. Counted up to the pod's `running`
        (a request the gateway still counts may have ended), never lowered, and shared by
        the pool's pods: they run one engine configuration (one `max_loras`), and a proof
        per pod stayed at 1 on pods the gateway then never sent a second adapter while
        one was in flight (family-0-7, TensorRT-LLM, 4 slots: 19 adapter loads against
        adapter-affine's 2).

        With replicas, only this replica's requests prove it, and only by a scrape taken
        after the row's last send. Another replica's request ended at the engine may
        still count here until its completion comes a flush later, and a shared scrape
        is written a flush after it was taken (picker.coordination.scrapes), so requests
        sent meanwhile may bring adapters it never saw running: on a 1-slot SGLang pool
        two replicas learned 2 and sent a second adapter beside running ones (twin,
        family-0-19, TTFT p50 1.26 -> 2.06 s). One replica learns as before: all its
        requests are its own, and a local scrape is looked at before any send after it.

        Only gauges set after the row's last send prove anything (`gauge_age_s`): SGLang's
        are as its scheduler last set them, and a scrape just after a send may show the
        batch before it, nothing waiting, while the new adapter waits for a slot; learned
        from those, family-0-97's pods of 2 slots got 3 (TTFT p95 3.8 s against
        best-ttft's 0.1 s; 0.09 s with the gauges dated)."""
        t = self.pool.table
        distinct = np.count_nonzero(self.adapter_local[index], axis=1)
        proof = fresh & (t.waiting[index] < 1.0) & (
            t.last_picked_at[index] <= t.scraped_at[index] - t.gauge_age_s[index])
        seen = np.minimum(distinct, t.running[index])[proof]
        self.adapter_slots[:] = max(self.adapter_slots.max(initial=0.0), seen.max(initial=0.0))
        self._judge_probe()

    def probe_capacity(self, now: float) -> float:
        """Adapters a pod without adapter metrics may run beside the proved slots' worth
        (filters.lora_state's free slot): one more while no probe is out and none was
        disproved at that level, else none.

        The slots are proved only by a scrape that saw more adapters running at once, and
        with the proved count as the limit the gateway never sends a pod one adapter more
        than that: a pool whose requests mostly share one adapter stayed at 1 of 3 slots
        (family-0-92, TensorRT-LLM on 2 H100 + 4 L40S: the second adapter went to idle
        L40Ss at 2.7x the TTFT while the H100s ran one adapter each). So one request at a
        time goes where it makes one adapter more than proved: a scrape then proves the
        level (`_learn_adapter_slots`), or shows a queue behind it, and the level stays
        unprobed. The cost, on a pool at its true limit, is that request's wait for a slot."""
        proved = self._proved_slots()
        if self._probe_out(now):
            return proved
        return proved + 1.0 if proved + 1.0 <= self.slot_cap else proved

    def _proved_slots(self) -> float:
        """The pool's proved adapter slots, at least one (`filters.adapter_capacity`)."""
        return max(float(self.adapter_slots.max(initial=0.0)), 1.0)

    def _probe_out(self, now: float) -> bool:
        """A probe was sent and is still waiting for its verdict."""
        return self.probe_at > 0 and now - self.probe_at < SLOT_PROBE_TIMEOUT_S

    def slot_knowledge(self, now: float) -> dict[str, float | int | None]:
        """What the pool knows of its adapter slots where pages publish none, for `igw
        explain`: proved (0: nothing yet), cap (a probe's queue; None: none), and the row
        and level of the probe out (None: none)."""
        out = self._probe_out(now)
        return {
            "proved": float(self.adapter_slots.max(initial=0.0)),
            "cap": None if math.isinf(self.slot_cap) else self.slot_cap,
            "probe_row": self.probe_row if out else None,
            "probe_level": self.probe_level if out else None,
        }

    def _note_probe(self, row: int, slot: int, now: float) -> None:
        """A send to a pod without adapter metrics that makes its adapters in flight more
        than the pool proved is the probe (`probe_capacity`), or, while one is out, is sent
        because no pod had a free slot (`filters.LoraCapable` keeps all then): only the
        first is judged.

        Another replica's send counts too (`remote`): each replica noting only its own,
        every replica had a probe of its own out at once, N adapters beyond the proof where
        one was meant, and each learned a one-slot pool's cap from a queue of its own
        (twin, family-0-19, SGLang with 1 slot, median p95 of 24 twin seeds against one
        replica: +5.8 % -> +1.0 % at N = 2, +18.0 % -> +5.8 % at N = 4). A remote probe is
        judged as a local one, except that only this replica's requests prove a level
        (`_learn_adapter_slots`): a proof the other replica saw ends it here by timeout."""
        if self.pool.table.max_lora[row] > 0 or self._probe_out(now):
            return
        inflight = self.adapter_inflight[row]
        level = float(np.count_nonzero(inflight)) + (0.0 if inflight[slot] > 0 else 1.0)
        if level > self._proved_slots():
            self.probe_at, self.probe_row, self.probe_level, self.probe_slot = now, row, level, slot

    def _judge_probe(self) -> None:
        """A proof at the probe's level ends it; so does a scrape of its pod with gauges set
        after it was sent that shows a queue while its adapter is still in flight there
        (the level is beyond the slots: `slot_cap`); an old one is dropped. The queue may
        have waited for the batch, not a slot: a later proof beyond the cap lifts it."""
        proved = self.adapter_slots.max(initial=0.0)
        if proved > self.slot_cap:  # the queue that capped it was no wait for a slot
            self.slot_cap = math.inf
        if self.probe_at <= 0:
            return
        t = self.pool.table
        row = self.probe_row
        seen_after = t.scraped_at[row] - t.gauge_age_s[row] >= self.probe_at
        if proved >= self.probe_level:
            self.probe_at = 0.0
        elif (seen_after and t.waiting[row] >= 1.0
              and self.adapter_inflight[row, self.probe_slot] > 0):
            self.slot_cap = min(self.slot_cap, self.probe_level - 1.0)
            self.probe_at = 0.0
        elif t.scraped_at[row] - self.probe_at > SLOT_PROBE_TIMEOUT_S:
            self.probe_at = 0.0

    def _adapter_bound(self, index: slice | np.ndarray) -> np.ndarray:
        """Rows whose queue may wait for an adapter slot: an adapter is waiting there that
        is not running, or the page says nothing of adapters (`max_lora` unknown: SGLang,
        TensorRT-LLM), so any wait may be one."""
        t = self.pool.table
        pending = (t.lora_waiting[index] & ~t.lora_running[index]).any(axis=1)
        return pending | (t.max_lora[index] <= 0)

    def since_scrape_tokens(
        self, index: slice | np.ndarray, dispatched: np.ndarray
    ) -> np.ndarray | None:
        """Prompt tokens sent to each row since its last scrape; None when there are none.

        A scrape zeroes `dispatched` and `on_dispatch` restarts `since_tokens`
        after a scrape, so a row with `dispatched == 0` has no tokens since.
        """
        if not dispatched.any():
            return None
        return self.since_tokens[index] * (dispatched > 0)

    def scrape_dated(self, row: int, at: float) -> None:
        """A scrape taken at `at` was just written into `row` though this replica sent
        requests to the pod after `at`: another replica's shared result, which arrives
        about a flushInterval after it was taken. Writing it zeroed the row's
        `dispatched` and restarted its tokens sent since the scrape, yet the scrape
        cannot show those sends, so the pod looked emptier than it was. This replica's
        own sends after `at` count again as sent since that scrape, and the prefill
        backlog's next fold leaves them out as the scrape does. Folded sends do
        not: they are dated when they were folded, up to a flush after they were sent,
        so most of those "after" the scrape are in it (counting them double-counted
        the owner's own sends to its pods: family-0-41 at N = 4, 3.61 -> 4.16 s in the
        twin). One that ended in between counts until the next scrape: the safe side."""
        self.sync()
        t = self.pool.table
        after = self.recent_at[row] > at
        if not after.any():
            return
        t.dispatched[row] = float(np.count_nonzero(after))
        self.since_stamp[row] = t.scraped_at[row]
        self.since_tokens[row] = float(self.recent_tokens[row][after].sum())
        self.since_uncached[row] = float(self.recent_uncached[row][after].sum())

    def prefill_backlog(self) -> np.ndarray:
        """Prompt tokens sent to each row that it had not prefilled at its last scrape.

        vLLM counts a request as `running` from the iteration that admits it,
        before its prefill is done, so right after a burst `waiting` shows
        nothing while the pod still has seconds of prefill ahead. The engine's
        prompt-token counter grows only when a prefill completes; the gateway
        knows what it sent. So at each scrape: backlog += sent since the
        previous scrape − the counter's growth (a decrease is a restart: the
        new value is the growth), kept within [0, prompt tokens of the
        gateway's unfinished requests]. The clamps absorb what the difference
        cannot see (other clients' requests, requests that failed before their
        prefill). NaN counter (engine without one): 0, no information.

        Folded lazily, here and before a dispatch to a row with a new scrape:
        until then nothing was sent after that scrape, so the fold is exact.
        """
        t = self.pool.table
        new = t.scraped_at != self.fold_stamp
        if new.any():
            rows = np.flatnonzero(new)
            counter = t.prompt_tokens_total[rows]
            done = counter - self.fold_counter[rows]
            done = np.where(done < 0, counter, done)
            # Sends counted as since a back-dated scrape (`scrape_dated`) came after it:
            # the engine's counter could not have them yet.
            late = np.where(self.since_stamp[rows] == t.scraped_at[rows],
                            self.since_tokens[rows], 0.0)
            sent = self.sent_tokens[rows] - late
            backlog = np.clip(self.backlog[rows] + sent - self.fold_sent[rows] - done,
                              0.0, t.outstanding_prefill[rows])
            self.backlog[rows] = np.where(np.isnan(backlog), 0.0, backlog)
            self.backlog_uncached[rows] = self._latest_uncached(rows, self.backlog[rows])
            self.fold_counter[rows] = counter
            self.fold_sent[rows] = sent
            self.fold_stamp[rows] = t.scraped_at[rows]
        return self.backlog

    def _latest_uncached(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Of each row's backlog (`tokens`, whole prompts), the tokens the pod has to
        compute: the uncached parts of its latest sends that make the backlog up, newest
        first (a pod prefills in arrival order, so what it has not prefilled is what came
        last); beyond the sends this replica remembers, the pod's expected cached share.

        Not the backlog × the pod's expected cached share: that share is an average over
        its sends, and one long new prompt behind a row of cached system prompts read as
        a tenth of its size (family-0-27: an H100 predicted 0.16 s for a request behind a
        7,364-token prompt sent 40 ms before; it took 0.67 s). Once per scrape a row,
        vectorized over the rows folded; the ring's slots, from the one before
        `recent_next` back, are the sends newest first."""
        order = (self.recent_next[rows, None].astype(np.int64) - 1 - _RING) % RECENT_SENDS
        sent = np.take_along_axis(self.recent_tokens[rows], order, axis=1)
        fresh = np.take_along_axis(self.recent_uncached[rows], order, axis=1)
        before = np.cumsum(sent, axis=1) - sent
        part = np.clip(tokens[:, None] - before, 0.0, sent)
        share = np.divide(fresh, sent, out=np.zeros_like(sent), where=sent > 0)
        rest = np.maximum(tokens - sent.sum(axis=1), 0.0) * (1.0 - self.cached_share[rows])
        return (part * share).sum(axis=1) + rest

    def backlog_uncached_work(self, index: slice | np.ndarray) -> np.ndarray:
        """The prefill backlog of rows `index` in tokens to compute (`_latest_uncached`)."""
        self.prefill_backlog()
        return self.backlog_uncached[index]

    def since_scrape_uncached(self, index: slice | np.ndarray,
                              dispatched: np.ndarray) -> np.ndarray | None:
        """`since_scrape_tokens` in tokens to compute: each send's prompt less what the
        prefix index expected cached on that pod; None when there are none."""
        if not dispatched.any():
            return None
        return self.since_uncached[index] * (dispatched > 0)

    def backlog_work(self, index: slice | np.ndarray) -> np.ndarray:
        """The prefill backlog of rows `index` in tokens to compute: cached prefixes
        count in the engine's counter but cost (almost) no prefill time."""
        return self.prefill_backlog()[index] * (1.0 - self.cached_share[index])

    def unseen_work(self, index: slice | np.ndarray, prompt: float,
                    unseen: np.ndarray) -> np.ndarray:
        """The prompts (`prompt` tokens each, as the waiting ones are counted) of rows
        `index`'s `unseen_requests`, in tokens to compute."""
        return unseen * prompt * (1.0 - self.cached_share[index])

    def unseen_requests(self, index: slice | np.ndarray) -> np.ndarray | None:
        """Where the page has no prefill clock (no prompt counter that grows as prefills
        end: SGLang counts prompts as requests finish, TensorRT-LLM not at all), the
        gateway's requests in flight on each row less those sent since its last scrape and
        those it showed running; 0 on rows with a clock; None where every row has one. A
        request in its prefill is in neither of SGLang's gauges, and those are as the
        scheduler last set them (at a prefill batch, every 40 decode steps), so `waiting`
        misses it."""
        t = self.pool.table
        blind = np.isnan(t.prompt_tokens_total[index])
        if not blind.any():
            return None
        unseen = np.maximum(t.inflight[index] - t.dispatched[index] - t.running[index], 0.0)
        return np.where(blind, unseen, 0.0)

    def blind_prefill(self, index: slice | np.ndarray, now: float
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """(seconds until the row is through the gateway's sends, learned uncached prefill
        speed) for rows `index` whose page has no prefill clock, 0 and 0 elsewhere; None when
        none of them has one with a learned speed. Read after `speeds(now)`, which rebuilds
        the speeds it uses.

        On such a page nothing shows a prefill in progress: SGLang's gauges are as it set
        them at its last prefill batch, so a cold prompt being prefilled, and every request
        sent while it is, are in neither of them. One cold 2,500-token prompt held an H200
        for 0.2 s while the gateway, seeing a short queue and counting in tokens of its
        counted speed (hot prefixes included, 6x the uncached one), sent it twelve more
        (family-0-43: SGLang, system prompts on 92 % of the requests; the p95 tail). The
        gateway knows what it sent and how much of each prompt it expected cached: this
        clock runs through those uncached tokens at the pod's uncached speed. It misses
        decode steps between prefills, so at moderate load it is early, the safe side for a
        floor under the latency model's wait (`predictedLatency`). Near saturation it runs
        late: the speed is one request's, read under its batch-mates, not the pod's
        throughput (five SGLang A10Gs at 95 % load: 13 s ahead of a pod that answered in
        1 s; without the clock that member was no better, docs/benchmarks.md, "The queue
        tie-break counts requests in prefill"). Not where the engine counts its prefills
        (vLLM): the prefill backlog is exact there, and this clock, at a speed learned under
        the batch-mates' prefills (slower than the GPU), ran late and cost the published
        uniform, prefix and LoRA scenarios 10-40 % (docs/benchmarks.md)."""
        speed = self._blind_tps[index]
        if not speed.any():
            return None
        return np.maximum(self.prefill_due[index] - now, 0.0), speed

    def prompt_estimate(self, req: SchedulingRequest) -> float:
        """Mean prompt size of recent requests (this one's until any was seen)."""
        if self.mean_prompt > 0:
            return self.mean_prompt
        return float(req.prompt_tokens) if req.prompt_tokens > 0 else DEFAULT_PROMPT_TOKENS

    def output_estimate(self) -> float:
        return self.mean_output if self.mean_output > 0 else DEFAULT_OUTPUT_TOKENS

    def speeds(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(prefill tokens/s, decode step s) for every table row, unknown speeds filled.

        A pod without a learned speed gets the pool median, scaled by the
        gateway's own observed pace of that pod (`observed_pace`) relative to the
        pool's median when it has one (else a deliberately slow default).
        Rebuilt at most every `SPEED_REFRESH_S` and on membership changes:
        speeds are learned over many requests and move slowly, and refilling
        (medians included) on every request would cost more than the rest of
        the latency model.
        """
        self.sync()
        if self._speed_version == self.pool.version and 0 <= now - self._speed_at < SPEED_REFRESH_S:
            return self._speed
        t = self.pool.table
        valid = t.valid
        ref_tps = _median_positive(t.prefill_tps[valid], DEFAULT_PREFILL_TPS)
        ref_step = _median_positive(t.decode_step_s[valid], DEFAULT_DECODE_STEP_S)
        pace = self.observed_pace()
        ref_pace = _median_positive(pace[valid], 0.0)
        slowness = np.ones(t.capacity)  # observed pace relative to the pool's median
        if ref_pace > 0:
            np.divide(pace, ref_pace, out=slowness, where=pace > 0)
        stale = _stale(t.speed_seen_at, now)
        counted = t.raw_cache_queries > 0
        uncached = np.where(counted, t.prefill_tps_uncached,
                            t.prefill_tps * (1.0 - self.cached_share))
        capacity = t.kv_num_blocks * t.kv_block_size  # tokens, from the pages' cache config
        tps, step = self._filled(valid, stale, slowness, uncached, counted, capacity,
                                 ref_tps, ref_step)
        learned = (t.prefill_tps > 0) & ~stale
        self._blind_tps = np.where(learned & np.isnan(t.prompt_tokens_total), uncached, 0.0)
        ratio = np.divide(uncached, t.prefill_tps, out=np.zeros(t.capacity),
                          where=learned & valid & (uncached > 0))
        self._uncached_ratio = min(_median_positive(ratio, 1.0), 1.0)
        self._own_uncached = np.where(learned & valid & counted, uncached, 0.0)
        self._speed = (tps, step)
        self._probe = self._probe_guess(tps, step, valid, capacity)
        self._cautious = None
        if stale.any():
            kept = self._filled(valid, np.zeros_like(stale), slowness, uncached, counted,
                                capacity, ref_tps, ref_step)
            self._cautious = (_slower((tps, step), kept),
                              None if self._probe is None else _slower(self._probe, kept))
        sized = capacity[valid & (capacity > 0)]
        self._smallest_cache = float(sized.min()) if len(sized) else 0.0
        self._one_cache_size = bool(len(sized) and len(sized) == np.count_nonzero(valid)
                                    and sized.max() <= sized.min() * (1.0 + TWIN_CAPACITY))
        self._speed_at = now
        self._speed_version = self.pool.version
        return self._speed

    def _filled(self, valid: np.ndarray, stale: np.ndarray, slowness: np.ndarray,
                uncached: np.ndarray, counted: np.ndarray, capacity: np.ndarray,
                ref_tps: float, ref_step: float) -> tuple[np.ndarray, np.ndarray]:
        """`speeds`' fill, the `stale` rows' learned speeds replaced by the pool median."""
        t = self.pool.table
        slowness = np.where(stale, 1.0, slowness)
        learned = (t.prefill_tps > 0) & ~stale
        tps = np.where(learned, _uncached_speeds(t.prefill_tps, uncached, learned, counted),
                       ref_tps / slowness)
        tps = speed_classes(tps, np.flatnonzero(valid), capacity)
        step = np.where((t.decode_step_s > 0) & ~stale, t.decode_step_s, ref_step * slowness)
        return tps, step

    def may_retry_stale(self) -> bool:
        """Whether a request may find a stale pod at the pool median: not before
        `STALE_RETRY_EVERY` of the pool's requests since the last went to a stale pod.

        Most stale pods are slow hardware the gateway rightly left alone, not pods that
        recovered. Retried at the median by every request, each looked as fast as the
        fleet's best every 5 s, took requests, re-learned its speed and went unused again:
        on 11 A10Gs beside 5 H200s 21 of 300 requests, all in the p95 tail (family-0-73,
        1.43x best-ttft; now 1.00x). The budget bounds what retries cost a pool at any
        request rate; retrying only with prompts under the pool's mean did not hold on a
        held-out seed (docs/benchmarks.md, 2026-12-06)."""
        return self._dispatches >= self._retry_after

    def cautious_speeds(self, now: float, index: slice | np.ndarray,
                        probe: bool) -> tuple[np.ndarray, np.ndarray]:
        """`speeds` of rows `index` (`probe_speeds` when `probe`) with no stale pod retried:
        each no faster than the speed it last showed."""
        tps, step = self.speeds(now)
        if self._cautious is None:
            return self._probed(index, tps, step, self._probe if probe else None)
        (tps, step), guess = self._cautious
        return self._probed(index, tps, step, guess if probe else None)

    def uncached_speed_ratio(self) -> float:
        """The pool's median of each pod's uncached prefill speed over its learned speed
        (1 where nothing is cached or nothing learned), as of the last `speeds`.

        The learned speeds count cached prompt tokens (the engine's prompt counter does),
        so where hot prefixes are cached they read several times what a prompt the pod has
        not seen gets: on the published prefix fleet 13.4k tokens/s against a true 1.7k
        uncached (A10Gs learned 1.2-1.5k). `predictedLatency` prices the tokens to compute
        (a request's own uncached ones, those sent since the scrape and the backlog's) at
        the learned speed times this ratio (`fresh_speeds`). One figure for the pool,
        not each pod's: a pod's own uncached speed reads under the GPU's when its prompts
        are mostly cached (the first step is in every prefill's time), and per pod that
        made the pods that had served the warm-up look slow for any new prompt. A pod's own
        uncached speed only ever raises the price's speed (`fresh_speeds`' floor), never
        lowers it."""
        return self._uncached_ratio

    def fresh_speeds(self, tps: np.ndarray, index: slice | np.ndarray) -> np.ndarray:
        """Per row of `index`, the speed of tokens to compute: its speed `tps` (`speeds`' row)
        times the pool's `uncached_speed_ratio`, but no slower than the pod's own uncached
        speed where its engine counts cache hits (nor faster than `tps`: a pod above its
        speed class's median keeps the class's).

        `speeds` leaves a pod whose prompts were less cached than the pool's median at its
        learned speed, which is then mostly uncached already: times the pool's ratio it was
        discounted twice. On four L40S behind one system prompt (family-0-63) the pod that
        had missed the warm-up learned 5.6k tokens/s, all of it uncached, and was priced at
        2.1k for a new prompt where it took 6.5k: predicted 3.4 s against a true 0.67, it
        took 18 of 300 requests and never warmed. A pod more cached than the median is
        priced at its own uncached speed either way (`_uncached_speeds` slows it so)."""
        return np.maximum(tps * self._uncached_ratio, np.minimum(tps, self._own_uncached[index]))

    def smallest_cache(self, now: float) -> float:
        """KV cache tokens of the pool's smallest pod that publishes its cache size (0: none
        does), refreshed with `speeds`: a pick compares it with `footprint` in O(1)."""
        self.speeds(now)
        return self._smallest_cache

    def one_cache_size(self, now: float) -> bool:
        """Every pod of the pool publishes its KV cache size and they agree within
        `TWIN_CAPACITY` (the same GPU's pods may differ by a few blocks): most likely one
        GPU, so their request counts compare (`prefix`'s balance); refreshed with `speeds`."""
        self.speeds(now)
        return self._one_cache_size

    def probe_speeds(self, now: float, index: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`speeds` of rows `index`, an untried idle pod given a guess that gets it tried.

        `speeds` gives an untried pod (no learned speed, no observed duration) the pool
        median, and the median is the majority's: in a fleet of mostly slow pods an idle
        fast one looked slow, got nothing, and so never showed its speed (family-0-80: 9
        A10Gs, 2 L40S, 2 H100s; an H100 and an L40S got none of 300 requests while an
        A10G took the p95 tail). Here such a pod takes the speeds of the known pods with
        its KV capacity (`_probe_guess`), else the fastest known: one request finds out.
        Only while nothing is in flight there (read per request, not from the speed
        cache): until that request ends the pod is back on the median, so a slow pod is
        tried once, not flooded. The scheduler asks for these for requests without an
        adapter only (`ScoringContext.speeds`): an adapter request would pay a load,
        perhaps a wait for a slot, and leave its adapter's home for the probe; probing
        with them moved the family's LoRA tails by seconds (docs/benchmarks.md).
        """
        tps, step = self.speeds(now)
        return self._probed(index, tps, step, self._probe)

    def _probed(self, index: slice | np.ndarray, tps: np.ndarray, step: np.ndarray,
                guess: _Speeds | None) -> tuple[np.ndarray, np.ndarray]:
        """Rows `index` of (`tps`, `step`), an untried idle pod given `guess`'s row."""
        tps, step = tps[index], step[index]
        if guess is None:
            return tps, step
        t = self.pool.table
        untried = (t.prefill_tps[index] <= 0) & (self.spot[index] <= 0) & (t.inflight[index] <= 0)
        if not untried.any():
            return tps, step
        return (np.where(untried, guess[0][index], tps),
                np.where(untried, guess[1][index], step))

    def _probe_guess(self, tps: np.ndarray, step: np.ndarray, valid: np.ndarray,
                     capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Per row, the speeds `probe_speeds` gives an untried pod: the mean learned speeds
        of the known pods whose KV capacity (tokens, from the page's cache config) is
        within `TWIN_CAPACITY` of its own, else the fastest known pod's. A pool's pods
        serve one model, so the same capacity means the same GPU memory, most likely the
        same GPU: probed at the fastest speed, each untried A10G beside known A10Gs took
        a request at an H100's guess, and those landed in the p95 tail (family-0-80; -37
        and -47 lost 6-10 % to them). Not proof: an A100-80GB and an H100 hold the same
        cache, as do an A10G and an L4; the pod then takes its twins' mean, no worse a
        guess than the median it had. Learned speeds even when stale: a stale pod's fill
        is the pool median, which as a twin's guess sent untried L4s a burst (family-0-93).
        None (no guess) until `PROBE_AFTER_KNOWN` of the pool's pods are known: in the
        first placements nearly every pod is untried, and guessing then spread the warm-up
        over pods whose one-request speeds later misled (family-0-11 1.05 -> 2.38x best-ttft;
        1.05x with the threshold; half the pool lost family-0-80's win).
        """
        t = self.pool.table
        known = valid & ((t.prefill_tps > 0) | (self.spot > 0))
        if not known.any() or np.count_nonzero(known) < PROBE_AFTER_KNOWN * np.count_nonzero(valid):
            return None
        guess_tps = np.full(t.capacity, tps[known].max())
        guess_step = np.full(t.capacity, step[known].min())
        sized = known & (capacity > 0)
        rows = np.flatnonzero(valid & ~known & (capacity > 0))
        if not sized.any() or not len(rows):
            return guess_tps, guess_step
        near = np.abs(capacity[rows, None] - capacity[sized]) <= TWIN_CAPACITY * capacity[sized]
        twins = near.sum(axis=1)
        has = twins > 0
        learned_tps = np.where(t.prefill_tps > 0, t.prefill_tps, tps)[sized]
        learned_step = np.where(t.decode_step_s > 0, t.decode_step_s, step)[sized]
        guess_tps[rows[has]] = (near[has] @ learned_tps) / twins[has]
        guess_step[rows[has]] = (near[has] @ learned_step) / twins[has]
        return guess_tps, guess_step

    def observed_pace(self) -> np.ndarray:
        """The gateway's own speed signal per row: seconds per output token (`spot`).

        A duration is mostly decode (output tokens x the step); prompt tokens cost 50-200x
        less each and a cached prefix nothing, so per prompt-plus-output token a slow
        pod serving long or cached prompts looks fast: in family-0-2 (TensorRT-LLM 70B on
        H100s and A10Gs, no speed on the page) two A10Gs read 0.0049-0.0067 s per token beside
        H100s at 0.004-0.006, joined their speed class and took the p95 tail. Per output token
        the generations stand apart as their decode steps do. While the pace was an average of
        per-request ratios, the per-output figure was the noisier on alike pods (uniform pools
        lost up to 30 % p95), so it was used only where the pods' figures showed a 1.5x gap;
        as a ratio of averages (`_pace`) it is steady enough everywhere: family p95 geomean
        0.999 / 0.975 / 0.973 on seeds 0-2 against the gated choice, seed 2 within 1.2x of
        best-ttft 72 -> 80 % (docs/benchmarks.md, "The pace per output token everywhere")."""
        return self.spot

    def invalidate_speeds(self) -> None:
        """Make the next `speeds` call re-read the table (tests, or after a bulk update)."""
        self._speed_at = -math.inf


def _uncached_speeds(tps: np.ndarray, uncached: np.ndarray, learned: np.ndarray,
                     counted: np.ndarray) -> np.ndarray:
    """Learned prefill speeds with what sets a pod serving hot prefixes ahead of its twins
    taken out, relative to the pool's median ratio of uncached to counted speed. Where the
    engine counts its cache hits (`counted`: picker.datalayer.speed) a pod under the median
    is slowed by that proportion and the others keep their speed; where the gateway's own
    expected cached share stands in (SGLang), every pod is scaled by it, both ways. Nothing
    cached, every ratio is 1 and the speeds are as learned.

    Not the uncached speeds themselves: they read under the GPU's (prefill time includes
    the batch-mates' and the first step's), and at that level flow control's start-delay
    bound held requests in the gateway (family-0-28, 7 A10Gs at 91 % load, 1.1k against a
    true 1.6k tokens/s: 0.96 -> 1.83x best-ttft; -72 failed 27 of its requests instead of
    none). Not sped up either: with the first step in every request's prefill time, a pod
    whose prompts were mostly cached reads a lower uncached speed than a twin serving cold
    ones, so raising the cold pod by its ratio split the prefix scenario's four A100s into
    two classes (0.17 against 0.09-0.13 uncached per counted token; p95 0.688 -> 1.085 s on
    two plan seeds of six). The gateway's estimate has no step in it, and slowing only
    (all pods) left SGLang's four H200s of family-0-43 (system prompts on 92 %) at 2.9x
    round-robin's p95, against 1.13x scaled both ways.
    """
    if not learned.any():
        return tps
    ratio = np.divide(uncached, tps, out=np.ones(len(tps)), where=(tps > 0) & (uncached > 0))
    np.minimum(ratio, 1.0, out=ratio)
    ref = float(np.median(ratio[learned]))
    scale = ratio / max(ref, 0.05)
    return tps * np.where(counted, np.minimum(scale, 1.0), scale)


def _stale(seen: np.ndarray | np.floating, now: float) -> np.ndarray | np.bool_:
    """A learned speed (per row, or one row's) with no new observation for `SPEED_STALE_S`
    (`seen`: when one last came, 0 never)."""
    return (seen > 0) & (now - seen > SPEED_STALE_S)


def _slower(speeds: _Speeds, other: _Speeds) -> _Speeds:
    """Per row the slower of two (prefill tokens/s, decode step s) pairs."""
    return np.minimum(speeds[0], other[0]), np.maximum(speeds[1], other[1])


def speed_classes(tps: np.ndarray, rows: np.ndarray,
                  capacity: np.ndarray | None = None) -> np.ndarray:
    """Prefill speeds with each class of similar pods given the class median.

    The learned prefill speed is noisy and biased: each request's prefill
    time includes its batch-mates' prompts, so identical pods read ±15 %
    apart depending on how their recent batches happened to form (measured
    on four identical A100 pods: 1,200-1,600 tokens/s); and the engine's
    prompt-token counts include cached prefixes, so a pod serving a hot
    system prompt reads up to ~1.4x faster than its identical neighbours
    (four A10Gs: 17,900 vs 13,200 tokens/s). Taken at face value that gives
    the "faster" pods more work: in a burst their queues run longest, and
    with shared prefixes the pod already holding hot prompts attracts the
    next new prompt too, until it overflows and a hot prompt is copied
    elsewhere. Pods whose speeds chain within `SPEED_CLASS_RATIO` of each
    other (sorted, no gap wider than that) form one class and share its
    median; GPU generations differ by 2.5x or more (an H100 prefills ~3x an
    A100, an A100 ~2.5x an A10G) and stay apart. Runs only when speeds are
    refreshed.

    With `capacity` (KV cache tokens per row, 0 where the page does not say), classes
    form first among the pods of one capacity (within `TWIN_CAPACITY`: the same GPU's
    pods may differ by a few blocks), then across: a pool's pods serve one
    model, so one capacity is most likely one GPU, and its median is a steadier reading
    than each pod's. Chained pod by pod, a pool's noise bridged generations: two A10Gs,
    two L40S and an A100 read 709, 966, 1,231, 1,766 and 2,026 tokens/s (true 1,451,
    3,752 and 3,234), no neighbours 1.5x apart, one class at 1,194, and the A10Gs took
    three times best-ttft's share, the p95 tail (family-0-18, 1.26 -> 1.13x best-ttft).
    Never apart by capacity alone: alike speeds of unlike caches (an H200 beside an
    H100 on a small model) still join, as before. The cost: a few pods of one capacity
    chain less readily than the whole pool, so one whose reading strays splits off sooner
    (family-0-51, four H200s paced by the gateway beside six H100s: 1.04 -> 1.31x).
    """
    out = tps.copy()
    if len(rows) < 2:
        return out
    values = tps[rows]
    if capacity is not None:
        values = _class_medians(values, _capacity_groups(capacity[rows]))
    out[rows] = _class_medians(values)
    return out


def _class_medians(values: np.ndarray, group: np.ndarray | None = None) -> np.ndarray:
    """Each value replaced by its class median, classes chained within `SPEED_CLASS_RATIO`
    (inside each `group`, ids >= 0, never across groups, when given); vectorized (one sort,
    medians of runs), so a pool of many small classes costs what one of a few does."""
    if group is None:
        order = np.argsort(values)
    else:  # one sort by (group, speed): speeds are positive, under the span added per group
        order = np.argsort(group * (2.0 * values.max() + 1.0) + values)
    ordered = values[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ordered[1:] > ordered[:-1] * SPEED_CLASS_RATIO
    if group is not None:
        starts[1:] |= group[order][1:] != group[order][:-1]
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, len(ordered)))
    medians = (ordered[first + (counts - 1) // 2] + ordered[first + counts // 2]) / 2.0
    out = np.empty_like(values)
    out[order] = medians[np.cumsum(starts) - 1]
    return out


def _capacity_groups(sizes: np.ndarray) -> np.ndarray:
    """Group id per entry: sorted KV capacities within `TWIN_CAPACITY` of their neighbour
    are one group (the same GPU's pods may differ by a few blocks); 0 (unknown) is one."""
    order = np.argsort(sizes)
    ordered = sizes[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = ordered[1:] > ordered[:-1] * (1.0 + TWIN_CAPACITY)
    group = np.empty(len(order), dtype=np.int64)
    group[order] = np.cumsum(new)
    return group


_ROW_ARRAYS = (
    "since_tokens", "since_stamp", "since_uncached", "spot", "paced_seconds", "paced_output",
    "slots", "slot_stamp", "slot_running", "slot_steps",
    "sent_tokens", "backlog", "backlog_uncached", "fold_stamp", "fold_sent", "fold_counter",
    "cached_share",
    "prefill_floor", "adapter_slots", "recent_next", "prefill_due",
)
_ROW_MATRICES = (("adapter_sent", MAX_ADAPTERS), ("adapter_inflight", MAX_ADAPTERS),
                 ("adapter_local", MAX_ADAPTERS),
                 ("recent_at", RECENT_SENDS), ("recent_tokens", RECENT_SENDS),
                 ("recent_uncached", RECENT_SENDS))


def _ewma_share(mean: float, value: float) -> float:
    """EWMA for a fraction that starts at 0 (0 is a valid value, not "unset")."""
    return mean + POD_EWMA_ALPHA * (value - mean)


def _ewma(mean: float, value: float, alpha: float) -> float:
    return value if mean <= 0 else mean + alpha * (value - mean)


def _median_positive(values: np.ndarray, default: float) -> float:
    known = values[values > 0]
    return float(np.median(known)) if len(known) else default
