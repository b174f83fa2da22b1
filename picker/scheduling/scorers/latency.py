"""`predictedLatency`: prefer the pod where THIS request would see its first token soonest.

Per candidate pod i, in seconds, with prefill_tps_i the learned speed (it counts cached
prompt tokens, as the engine's prompt counter does) and fresh_tps_i = prefill_tps_i ×
uncached_ratio the speed of tokens the pod has to compute, no slower than the pod's own
uncached speed (`PoolState.fresh_speeds`):

    ahead_i   = max(waiting_i × mean_prompt / prefill_tps_i,
                    prefill backlog_i in tokens to compute / fresh_tps_i)
              + tokens to compute the gateway sent since i's last scrape / fresh_tps_i
    own_i     = prompt_tokens × (1 − prefix match fraction_i)      (uncached part only)
    slots_i   = max(0, running_i + waiting_i + dispatched_i + 1 − batch_capacity)
    ttft_i    = ahead_i + own_i / fresh_tps_i                       prefill work ahead + ours
                (own_i / prefill_tps_i where the prompt outgrows its holders, below),
                at least  due_i + own_i / uncached_tps_i   where the page has no prefill
                          clock (SGLang): due_i is when the pod is through the uncached
                          prompts the gateway sent it (`PoolState.blind_prefill`)
              + slots_i × mean_output × decode_step_i / batch_capacity   wait for a batch slot
              + decode_step_i                                       the first step itself
              + max(0, iteration_i − decode_step_i)   a busy engine's longer steps, where
                                                      its page shows them (TensorRT-LLM)
              + lora_load        when the request's adapter is not resident on i

score_i = min(ttft) / ttft_i, so the best pod gets 1 and a pod twice as slow 0.5.

Tokens to compute at the speed of tokens to compute (`PoolState.uncached_speed_ratio`):
under hot system prompts the learned speed reads 13.4k tokens/s where a prompt the pod has
not seen prefills at 1.7k, so at the learned speed a cold pod's prefill looked 8x cheaper
than it is, and so did a long new prompt just sent to a pod (the backlog and the sends
since the scrape are counted per send, each prompt less what the prefix index expected
cached there: `PoolState._latest_uncached`). The waiting queue is whole prompts of unknown
mix, at the learned speed as before. One exception keeps a copy cheap: where the request's
prompt root took more of the pool's recent requests than the candidates holding it are of
the candidates (`outgrows_holders`), its holders cannot carry it alone and a copy is worth
the requests that follow, so its own prompt stays at the learned speed there. Family (300
members, three seeds) 0.994 / 0.988 / 0.992 geometric mean p95; the published prefix plan
1.15 -> 0.95 s in the twin, its four-times-longer plan 0.53 -> 0.55 s (docs/benchmarks.md,
"Tokens to compute at the speed of tokens to compute").

This is the one signal that weighs heterogeneous pods correctly: a fast pod
with a short queue beats an idle slow one, and stops beating it once its
queue holds more work than the speed difference is worth. Speeds come from
the datastore (learned from scrapes), unknown ones filled by `PoolState.speeds`
(pool median scaled by the gateway's own observed speed of the pod; an untried idle pod,
for a request without an adapter, guessed so it gets tried: `PoolState.probe_speeds`).

Why not `outstanding_prefill` as the work ahead: it holds the prompts of
every unfinished request, most of them already past prefill and counted in
`running`. But `waiting` misses requests admitted into the batch whose
prefill has not finished (vLLM counts them as running): the prefill backlog
(`PoolState.prefill_backlog`: prompt tokens sent minus the engine's prompt
counter growth, in tokens to compute) covers them.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.filters import lora_state
from picker.scheduling.plugins import SCORERS

# vLLM's default max_num_seqs; engines do not publish it (see docs/scoring.md).
DEFAULT_BATCH_CAPACITY = 256
# Loading a LoRA adapter from the host cache into GPU memory: tens of ms (vLLM,
# adapters of a few hundred MB over PCIe); a conservative round figure.
LORA_LOAD_S = 0.05
# Predicted TTFTs within this fraction of the best count as a tie (see `near_best`).
NEAR_BEST = 0.25


@SCORERS.register
class PredictedLatency:
    name: ClassVar[str] = "predictedLatency"

    def __init__(self, batch_capacity: int = DEFAULT_BATCH_CAPACITY) -> None:
        self.batch_capacity = float(batch_capacity)

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        return latency_score(ctx, self.batch_capacity)


def latency_score(
    ctx: ScoringContext, batch_capacity: float = DEFAULT_BATCH_CAPACITY
) -> np.ndarray:
    """min(ttft) / ttft per candidate: predictedLatency's score, computed once per
    request whichever of it and the gated tie-breakers asks first."""
    if ctx.latency is None:
        ttft = cached_ttft(ctx, batch_capacity)
        ctx.latency = ttft.min() / ttft
    return ctx.latency


def near_best(ctx: ScoringContext, ratio: float = 1.0 + NEAR_BEST) -> np.ndarray:
    """True where the predicted TTFT is at most `ratio` times the best candidate's (by
    default within `NEAR_BEST` of it).

    The spreading tie-breakers (queue, runningRequests, lru in the llm-d
    profile) vote only among these: min-max normalization turns any
    difference into a full point, which must not outvote a real TTFT gap.
    """
    return latency_score(ctx) >= 1.0 / ratio


def cached_ttft(ctx: ScoringContext, batch_capacity: float) -> np.ndarray:
    """`predicted_ttft`, computed once per request and capacity (filters and scorers share it)."""
    cached = ctx.ttft
    if cached is None or cached[0] != batch_capacity:
        cached = ctx.ttft = (batch_capacity, predicted_ttft(ctx, batch_capacity))
    return cached[1]


def predicted_ttft(ctx: ScoringContext, batch_capacity: float) -> np.ndarray:
    """Expected time to first token of `ctx.req` on each candidate, in seconds."""
    state = ctx.state
    req = ctx.req
    tps, step = ctx.speeds()
    # Work ahead as of the scrape: the waiting queue, what the gateway sent that the pod
    # had not prefilled yet (vLLM counts admitted requests as running), or, on a page
    # without a prefill clock, its requests the scrape did not show running, whichever is
    # most; then what was sent since. The waiting queue is whole prompts, at the learned
    # speed; the rest is tokens to compute, at the speed of those (see the docstring).
    prompt = state.prompt_estimate(req)
    fresh_tps = state.fresh_speeds(tps, ctx.index)
    ahead = np.maximum(ctx.col("waiting") * prompt / tps,
                       state.backlog_uncached_work(ctx.index) / fresh_tps)
    unseen = ctx.unseen_requests()
    if unseen is not None:
        ahead = np.maximum(ahead, state.unseen_work(ctx.index, prompt, unseen) / tps)
    since = state.since_scrape_uncached(ctx.index, ctx.col("dispatched"))
    ttft = ahead if since is None else ahead + since / fresh_tps
    own = float(max(req.prompt_tokens, 0))
    matched = ctx.prefix_matched()
    own_work = own if matched is None else own - matched * (own / len(ctx.hashes))
    # A prompt that outgrows its holders is copied at the counted speed: see the docstring.
    copy_tps = tps if matched is not None and outgrows_holders(ctx, matched) else fresh_tps
    ttft = ttft + own_work / copy_tps
    # Where the page has no prefill clock, no sooner than the pod can be through what the
    # gateway sent it, and then ours, in uncached tokens at the uncached speed.
    blind = state.blind_prefill(ctx.index, ctx.now)
    if blind is not None:
        wait, uncached_tps = blind
        fluid = wait + own_work / np.where(uncached_tps > 0, uncached_tps, 1.0)
        ttft = np.where(uncached_tps > 0, np.maximum(ttft, fluid), ttft)
    ttft += step
    # Where the page shows its step lengths (TensorRT-LLM: no token counter, so no backlog):
    # the next step is as long as the recent ones, prefill of what it admitted included;
    # a plain step is counted above (`iteration_s`, 0 while idle or unknown: every pod of
    # a pool whose page has no step counter, so those skip the arithmetic).
    iteration = ctx.col("iteration_s")
    if iteration.any():
        ttft += np.maximum(iteration - step, 0.0)
    lora = lora_state(ctx)
    if lora is not None:
        ttft += np.where(lora[0], 0.0, LORA_LOAD_S)
    running = ctx.col("running")
    queue = ctx.queue_depth()
    if running.max() + queue.max() + 1.0 > batch_capacity:
        slots = np.maximum(running + queue + (1.0 - batch_capacity), 0.0)
        ttft += slots * step * (state.output_estimate() / batch_capacity)
    return ttft


def outgrows_holders(ctx: ScoringContext, matched: np.ndarray) -> bool:
    """The request's prompt root (its first block) took more of the pool's recent requests
    than the candidates holding it are of the candidates (`PoolState.demand`): one pod
    holds it of four, and it is more than a quarter of the traffic."""
    share = ctx.state.demand.share(ctx.hashes[0], ctx.now)
    return share * len(matched) > np.count_nonzero(matched)
