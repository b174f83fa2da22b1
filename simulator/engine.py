"""The engine model of one pod: FCFS queue, continuous batching, KV cache, LoRA slots.

One asyncio task per pod runs scheduler iterations back to back and sleeps until each
iteration's model end time; requests only wait on a future that the loop resolves when they
get tokens. Per-token work is a few attribute updates, so many pods fit in one process.

Time: the engine's clock is ``loop.time() * time_scale`` ("model seconds"); every latency it
reports is in model seconds, while it sleeps ``model seconds / time_scale`` of wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from simulator.kv_cache import Allocation, KVCache
from simulator.lora import LoraSlots
from simulator.profiles import EngineProfile
from simulator.stats import EngineStats

# SGLang's scheduler sets its load gauges (num_running_reqs, num_queue_reqs, token_usage)
# when it schedules a prefill batch, every `decode_log_interval` decode steps (default 40)
# and, idle, every 30 s; a scrape reads the last values set. The running count is the
# decode batch: a request in its prefill is in neither gauge. Read in the scheduler and
# metrics collector of SGLang 0.4.3.post3 to 0.5.5 (log_prefill_stats, log_decode_stats,
# check_memory).
SGLANG_DECODE_LOG_INTERVAL = 40
SGLANG_IDLE_LOG_S = 30.0


@dataclass(frozen=True, slots=True)
class PublishedGauges:
    """The load gauges as SGLang's scheduler last set them, and when (model time)."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    usage: float = 0.0
    at: float = 0.0


# The loop wakes this much before an iteration's end: the kernel's wake-up latency (about
# 0.1-0.2 ms here on simulator.clock's precise loop), so tokens leave close to their model time.
EARLY_WAKE_S = 0.0002
LORA_INFO_SERIES = 16  # adapter-set combinations kept as vllm:lora_requests_info series
# After this long without tokens, gen_throughput reads 0 (SGLang logs per interval).
THROUGHPUT_WINDOW_S = 1.0


class QueueFull(Exception):
    """The waiting queue is at max_queue (the server answers 503)."""


class PromptTooLong(ValueError):
    """The prompt cannot fit the model's context (the server answers 400)."""


@dataclass(frozen=True)
class EngineConfig:
    """Per-pod knobs that are not hardware figures."""

    model: str
    profile: EngineProfile
    max_num_seqs: int = 256
    max_loras: int = 1
    max_queue: int = 1024
    max_num_batched_tokens: int = 8192
    time_scale: float = 1.0


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request's engine-side state; times are model seconds."""

    model: str
    adapter: str | None
    prompt_tokens: int
    hashes: list[int]
    max_tokens: int
    stream: bool
    explicit_max: bool = True
    arrival: float = 0.0
    generated: int = 0
    cached_tokens: int = 0
    admitted_once: bool = False
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    finished_at: float = 0.0
    finished: bool = False
    error: str | None = None
    alloc: Allocation | None = None
    waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    async def progress(self) -> None:
        """Wait until the engine hands this request more tokens (streaming) or finishes it."""
        if self.finished:
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiter = fut
        try:
            await fut
        finally:
            self.waiter = None

    def wake(self) -> None:
        fut = self.waiter
        if fut is not None and not fut.done():
            fut.set_result(None)


class Engine:
    """vLLM-like scheduler over a KV cache and LoRA slots; see docs/simulator.md."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = config.profile
        self.kv = KVCache(config.profile.num_gpu_blocks)
        self.lora = LoraSlots(config.max_loras)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self.slowdown = 1.0
        self.iteration = 0
        self.published = PublishedGauges()
        self._decode_steps = 0
        self._prefill_batch = False
        self.gen_throughput = 0.0
        self._window_start = 0.0
        self._window_tokens = 0
        self._last_end = 0.0
        self._iter_start = 0.0
        self._lora_series: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name=f"engine-{self.config.model}")

    async def stop(self) -> None:
        """Cancel the loop and fail every request in flight (a crash loses them all)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in [*self.running, *self.waiting]:
            self._release(req)
            req.error = "engine stopped"
            req.finished = True
            req.wake()
        self.running.clear()
        self.waiting.clear()

    def now(self) -> float:
        """Model time in seconds."""
        loop = self._loop or asyncio.get_running_loop()
        return loop.time() * self.config.time_scale

    # ----- request API -----------------------------------------------------------------------

    def submit(self, req: SimRequest, at: float | None = None) -> None:
        """Queue a request (FCFS) or raise QueueFull / PromptTooLong. ``at`` is its arrival in
        model time for a caller that keeps its own clock (bench/replay.py); default now."""
        if req.prompt_tokens + 1 > self.profile.max_model_len:
            raise PromptTooLong(
                f"This model's maximum context length is {self.profile.max_model_len} tokens. "
                f"However, your request has {req.prompt_tokens} input tokens."
            )
        if len(self.waiting) >= self.config.max_queue:
            self.stats.rejected += 1
            raise QueueFull(f"waiting queue is full ({self.config.max_queue})")
        req.max_tokens = max(1, min(req.max_tokens, self.profile.max_model_len - req.prompt_tokens))
        req.arrival = self.now() if at is None else at
        self.waiting.append(req)
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """Drop a request whose client went away, freeing its slot and blocks."""
        if req.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.finished = True
        req.error = "aborted"
        self.stats.aborted += 1

    def record_lateness(self, model_time: float) -> None:
        """How late (wall ms) a response left compared with the model time it was due."""
        wall_late = (self.now() - model_time) / self.config.time_scale
        self.stats.lateness_ms.append(wall_late * 1000.0)

    # ----- scheduler loop --------------------------------------------------------------------

    async def _run(self) -> None:
        scale = self.config.time_scale
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            start = self._iteration_start()
            duration = self.begin_iteration(start)
            if not self.running:  # nothing admissible right now: wait for a change
                self._wake.clear()
                await self._wake.wait()
                continue
            end = start + duration
            delay = (end - self.now()) / scale - EARLY_WAKE_S
            if delay > 0:
                await asyncio.sleep(delay)
            self.end_iteration(start, end)

    def _iteration_start(self) -> float:
        """Model time this iteration starts: right after the previous one while busy, or when
        the work arrived after an idle spell, never when this task happened to be woken (so
        event-loop delays show up as lateness, not as model queue time)."""
        now = self.now()
        if self._last_end >= now:
            return self._last_end
        if self.running or not self.waiting:
            return self._last_end  # the loop woke late for an iteration that was due
        return max(self._last_end, min(now, self.waiting[0].arrival))

    def begin_iteration(self, start: float) -> float:
        """Plan the iteration starting at model time ``start``: grow decoding sequences
        (preempting if needed), admit waiting requests, and return its model duration. With
        nothing running afterwards there is nothing to run. ``_run`` drives this in real time;
        bench/replay.py drives the same model in virtual time."""
        self._iter_start = start
        preempted = False
        i = 0
        while i < len(self.running):
            if self._ensure_blocks(self.running[i]):
                i += 1
            else:
                preempted = True
        decoding = len(self.running)  # each has its first token from an earlier iteration
        prefill_tokens, loads = (0, 0) if preempted else self._admit()
        self._prefill_batch = len(self.running) > decoding
        if self._prefill_batch:  # SGLang logs a prefill batch before running it
            self._publish(decoding, start)
        profile = self.profile
        duration = (
            profile.step_s(len(self.running))
            + prefill_tokens / profile.prefill_tokens_per_s
            + loads * profile.lora_load_ms / 1000.0
        )
        return duration * self.slowdown

    def _ensure_blocks(self, req: SimRequest) -> bool:
        """Give req the blocks its next token needs, preempting the newest running requests
        (recompute) when the cache is full; False when req itself was preempted."""
        assert req.alloc is not None
        need = math.ceil(req.context_tokens / self.profile.block_size)
        while req.alloc.blocks < need:
            if self.kv.grow(req.alloc):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: SimRequest) -> None:
        self._release(req)
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def _admit(self) -> tuple[int, int]:
        """Move waiting requests into the batch in FCFS order while slots, the token budget
        and KV blocks allow; a request whose adapter cannot get a slot is skipped, as vLLM
        does. Returns (uncached prompt tokens to prefill, adapters to load)."""
        budget = self.config.max_num_batched_tokens
        block = self.profile.block_size
        prefill_tokens = loads = 0
        skipped: list[SimRequest] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            tokens = req.context_tokens
            hits = self.kv.match(req.hashes, (tokens - 1) // block)
            uncached = tokens - hits * block
            if prefill_tokens and prefill_tokens + uncached > budget:
                break
            if req.adapter is not None and not self.lora.can_acquire(req.adapter):
                skipped.append(self.waiting.popleft())
                continue
            alloc = self.kv.allocate(req.hashes, hits, math.ceil(tokens / block))
            if alloc is None:
                break
            self.waiting.popleft()
            if req.adapter is not None and self.lora.acquire(req.adapter):
                loads += 1
            req.alloc = alloc
            self._count_admission(req, tokens, hits * block)
            self.running.append(req)
            prefill_tokens += uncached
        self.waiting.extendleft(reversed(skipped))
        return prefill_tokens, loads

    def _count_admission(self, req: SimRequest, tokens: int, cached: int) -> None:
        self.stats.prefix_queries += tokens
        self.stats.prefix_hits += cached
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = cached
            req.scheduled_at = self._iter_start

    def end_iteration(self, start: float, end: float) -> None:
        """End of the iteration begun at ``start``: every running sequence gets one token."""
        self._last_end = end
        self.iteration += 1
        stats = self.stats
        itl_batch = 0
        finished: list[SimRequest] = []
        # Newest first: the requests getting their first token were admitted last, and their
        # handlers should write before the decode streams' (TTFT is what routing is judged by).
        for req in reversed(self.running):
            if req.generated == 0:
                self._first_token(req, end)
            elif req.last_token_at == start:
                itl_batch += 1
            else:  # first token after a preemption's recompute
                stats.itl.observe(end - req.last_token_at)
            req.generated += 1
            req.last_token_at = end
            if req.generated >= req.max_tokens:
                finished.append(req)
            elif req.stream:
                req.wake()
        if itl_batch:
            stats.itl.observe(end - start, itl_batch)
        produced = len(self.running)
        stats.generation_tokens += produced
        self._track_throughput(start, end, produced)
        for req in finished:
            self._finish(req, end)
        if not self._prefill_batch:
            self._decode_steps += 1
            if self._decode_steps % SGLANG_DECODE_LOG_INTERVAL == 0:
                self._publish(len(self.running), end)

    def _publish(self, running: int, at: float) -> None:
        kv = self.kv
        self.published = PublishedGauges(running, len(self.waiting),
                                         kv.used_blocks * self.profile.block_size, kv.usage, at)

    def sglang_gauges(self, now: float | None) -> PublishedGauges:
        """The gauges a scrape at model time `now` reads (`published`, or the idle refresh
        when the engine has been idle since 30 s after the last setting)."""
        if (now is not None and not self.running and not self.waiting
                and now >= self.published.at + SGLANG_IDLE_LOG_S):
            self._publish(0, self.published.at + SGLANG_IDLE_LOG_S)
        return self.published

    def _first_token(self, req: SimRequest, end: float) -> None:
        req.first_token_at = end
        stats = self.stats
        stats.prompt_tokens += req.prompt_tokens
        stats.ttft.observe(end - req.arrival)
        stats.queue_time.observe(req.scheduled_at - req.arrival)
        stats.prefill_time.observe(end - req.scheduled_at)

    def _finish(self, req: SimRequest, end: float) -> None:
        self.running.remove(req)
        self._release(req)
        req.finished = True
        req.finished_at = end
        stats = self.stats
        stats.success[finish_reason(req)] += 1
        stats.finished_prompt_tokens += req.prompt_tokens
        stats.finished_generation_tokens += req.generated
        stats.e2e.observe(end - req.arrival)
        if req.generated > 1:
            stats.tpot.observe((end - req.first_token_at) / (req.generated - 1))
        req.wake()

    def _release(self, req: SimRequest) -> None:
        """Give back blocks and the adapter pin of a running request (no-op otherwise)."""
        if req.alloc is None:
            return
        self.kv.free(req.alloc)
        req.alloc = None
        if req.adapter is not None:
            self.lora.release(req.adapter)

    def _track_throughput(self, start: float, end: float, tokens: int) -> None:
        if end - self._window_start > 2 * THROUGHPUT_WINDOW_S:  # idle gap: open a new window
            self._window_start = start
            self._window_tokens = 0
        self._window_tokens += tokens
        elapsed = end - self._window_start
        if elapsed >= THROUGHPUT_WINDOW_S:
            self.gen_throughput = self._window_tokens / elapsed
            self._window_start = end
            self._window_tokens = 0

    # ----- observation -----------------------------------------------------------------------

    def current_gen_throughput(self) -> float:
        """Tokens/s over the last full window; 0 once the engine has been idle a window."""
        if self.now() - self._window_start > 2 * THROUGHPUT_WINDOW_S:
            return 0.0
        return self.gen_throughput

    def lora_sets(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting requests), sorted."""
        running = {r.adapter for r in self.running if r.adapter is not None}
        waiting = {r.adapter for r in self.waiting if r.adapter is not None}
        return sorted(running), sorted(waiting)

    def lora_info_series(self, wall_now: float) -> list[tuple[tuple[str, str], float]]:
        """vllm:lora_requests_info series: (running, waiting) comma-joined adapter sets, each
        with the wall time it was last current (now for the current one), newest last."""
        running, waiting = self.lora_sets()
        key = (",".join(running), ",".join(waiting))
        series = self._lora_series
        series[key] = wall_now
        series.move_to_end(key)
        while len(series) > LORA_INFO_SERIES:
            series.popitem(last=False)
        return list(series.items())

    def state(self) -> dict[str, Any]:
        """Exact engine figures, for tests and the admin endpoint."""
        stats = self.stats
        running_loras, waiting_loras = self.lora_sets()
        return {
            "model": self.config.model,
            "iteration": self.iteration,
            "now": self.now(),
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_gpu_blocks": self.kv.num_blocks,
            "num_used_blocks": self.kv.used_blocks,
            "num_cached_blocks": self.kv.cached_blocks,
            "kv_cache_usage": self.kv.usage,
            "block_size": self.profile.block_size,
            "prefix_cache_queries": stats.prefix_queries,
            "prefix_cache_hits": stats.prefix_hits,
            "num_preemptions": stats.preemptions,
            "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
            "finished_prompt_tokens": stats.finished_prompt_tokens,
            "finished_generation_tokens": stats.finished_generation_tokens,
            "sglang_gauges": dataclasses.asdict(self.published),
            "request_success": dict(stats.success),
            "requests_aborted": stats.aborted,
            "requests_rejected": stats.rejected,
            "running_lora_adapters": running_loras,
            "waiting_lora_adapters": waiting_loras,
            "resident_lora_adapters": self.lora.resident,
            "lora_loads": self.lora.loads,
            "max_loras": self.lora.max_loras,
            "max_num_seqs": self.config.max_num_seqs,
            "slowdown": self.slowdown,
            "time_scale": self.config.time_scale,
            "gen_throughput": self.current_gen_throughput(),
            "histograms": {
                "ttft": stats.ttft.as_dict(),
                "queue_time": stats.queue_time.as_dict(),
                "prefill_time": stats.prefill_time.as_dict(),
                "e2e": stats.e2e.as_dict(),
                "tpot": stats.tpot.as_dict(),
                "itl": stats.itl.as_dict(),
            },
            "lateness_ms": stats.lateness_summary(),
            "profile": self.profile.as_dict(),
        }


def finish_reason(req: SimRequest) -> str:
    """"length" when the client capped the output, "stop" when it ran to the default length
    (the simulator's stand-in for an end-of-sequence token)."""
    return "length" if req.explicit_max else "stop"
