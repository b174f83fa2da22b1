"""`prefix`: prefer pods the gateway last sent this prompt's leading blocks to.

Score = matched leading blocks / the request's blocks (0 without blocks), from
the pool's `PrefixIndex`. A pod that served the prefix most likely still has
its KV blocks cached and skips that part of the prefill.

With `max_ttft_ratio` (the llm-d profile: 4) the score is 0 for pods whose
predicted TTFT is more than that many times the best candidate's. Affinity is
worth some wait, since the prefix cached on fewer pods serves the requests that
follow; but at prefix weight 4.5 against the latency model's 3 it outvoted any
wait, and where one pod held a hot system prompt the gateway kept sending there
while a cold prompt held it for 0.2 s (family-0-43, docs/benchmarks.md). A
bound of 2x cost the published prefix scenario a quarter of its p95; 4x kept it.

With `ample_cache` (the llm-d profile: 0.1) the score is 0 for every candidate while the
prefixes the pool's requests share (`PoolState.footprint`: each shared prefix once) take
less than that share of the pool's smallest KV cache. Every pod can then hold every
shared prefix, and affinity only keeps a hot one on the few pods that served it first:
they queue while the others idle (family-0-43: 3 system prompts on 4 H200s, best-ttft
1.45x round-robin, which warms every pod). The latency model still prices the prefill a
pod without the prefix would do, so a cold pod is taken when the warm ones' queues cost
more than that prefill. Where caches are small beside the shared prefixes (the published
prefix scenario: 6 prompts, half an A10G's cache) affinity partitions them and keeps it.

With `balance` (the llm-d profile: 2) the score is 0 on pods running more than `balance`
times (the least busy candidate's in-flight requests + `BALANCE_FLOOR`), where every pod
of the pool publishes one KV cache size (`PoolState.one_cache_size`: most likely the same
GPU, so in-flight counts compare). A partition can come out uneven: on 4 A10Gs the
hottest of six prompts (41 % of requests) stayed on one pod running 20-29 requests while
another, holding only cold prompts, ran 2-4 and took 0-89 of 882 requests; for each next
request of the hot prompt the holder was still the better pod (a 150-token question
against the idle pod's 2,000-token prefill), so nothing evened it. Off affinity, the
latency model sends some of them to the idle pod, which then holds the prompt too. Pods
of different sizes are left alone: an H100 beside A10Gs rightly runs more.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS
from picker.scheduling.scorers.latency import near_best

# Requests added to the least busy pod's count before `balance` multiplies it: near idle,
# a few requests more on one pod are no imbalance worth a copy of a prompt.
BALANCE_FLOOR = 4.0


@SCORERS.register
class Prefix:
    name: ClassVar[str] = "prefix"

    def __init__(self, max_ttft_ratio: float = 0.0, ample_cache: float = 0.0,
                 balance: float = 0.0) -> None:
        self.max_ttft_ratio = max_ttft_ratio
        self.ample_cache = ample_cache
        self.balance = balance

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        fraction = ctx.prefix_fraction()
        if fraction is None or self._caches_ample(ctx):
            return 0.0
        if self.max_ttft_ratio > 0:
            fraction = fraction * near_best(ctx, self.max_ttft_ratio)
        if self.balance > 0 and ctx.state.one_cache_size(ctx.now):
            inflight = ctx.col("inflight")
            fraction = fraction * (inflight <= self.balance * (inflight.min() + BALANCE_FLOOR))
        return fraction

    def _caches_ample(self, ctx: ScoringContext) -> bool:
        """True where the pool's shared prefixes (`PoolState.footprint`) take less than
        `ample_cache` of the pool's smallest known KV cache."""
        if self.ample_cache <= 0:
            return False
        smallest = ctx.state.smallest_cache(ctx.now)
        return smallest > 0 and ctx.state.footprint.tokens < self.ample_cache * smallest
