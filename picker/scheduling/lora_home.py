"""`lora-home`: send an adapter request where its adapter already is, unless that costs too much.

Scoring alone spread adapters: `loraAffinity` is one vote among the weighted
scorers, and a pod where the adapter is not loaded scores only 0.2 less than one
where it is, so whichever pod's predicted TTFT was a little better won and the
adapter was loaded there too. With few slots per pod that churns: each load
evicts another adapter, and a request whose adapter has no free slot waits in
the engine until a running one ends (the LoRA p95 tail). The replay's
adapter-affine policy, which keeps each adapter where it is resident while that
pod's queue is within a quarter second of the least-loaded pod's, loaded up to
67x fewer adapters and beat the gateway's p95 by up to 8x on the scenario family.

So, for an adapter request: when some candidates hold the adapter (running or
queued there by the last scrape, or sent there lately and still among the pod's
most recently sent adapters: `filters.lora_state`) and the best predicted TTFT
among them is within HOME_SLACK_S of the best overall, only they are kept;
otherwise every candidate the `lora` filter kept stays (spill). Measured on the
44 LoRA scenarios of the family (seed 0, docs/benchmarks.md): TTFT p95 0.86x
(geometric mean), scenarios within 1.2x of best-ttft 45 % -> 52 %, adapter loads
within 1.5x of adapter-affine's 49 % -> 59 %; slacks of 0.1 s and 0.5 s did worse.

The slack is what a spill may cost in churn: the adapter it evicts, or the slot a later
adapter without a home then waits for. Where the pool's slots are plenty for its adapters
(at least SPARE_SLOTS_PER_ADAPTER each, `filters.slots_abound`), a pod with a free slot churns
nothing, so against those the home gets no slack: only the load, which the predicted TTFT
already holds. A quarter second was a dozen first tokens of a small model on fast GPUs:
family-1-42 (a 3B model with 6 adapters and 3 slots on 7 pods, L4 + H100 + L40S) kept its
most popular adapter on the L40S and L4s where it had first landed, with H100s free, at
4.1x best-ttft. Where slots are scarce a spill into a free one takes it from an adapter
that has no home yet, which then starves behind running ones (family-0-44: 19 adapters in
20 slots, 1.2x -> 23x best-ttft when every free slot counted as free).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.filters import lora_state, slots_abound
from picker.scheduling.plugins import FILTERS
from picker.scheduling.scorers.latency import DEFAULT_BATCH_CAPACITY, cached_ttft

# How much longer a request may expect to wait for its first token at a pod holding its
# adapter than at the fastest candidate (seconds): about one A10G prefill of a median
# chat prompt, the adapter-affine yardstick's slack.
HOME_SLACK_S = 0.25


@FILTERS.register
class LoraHome:
    name: ClassVar[str] = "lora-home"
    reason: ClassVar[str] = "lora-not-home"
    degrade_when_empty: ClassVar[bool] = False

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        n = len(ctx.rows)
        state = lora_state(ctx)
        if state is None:
            return np.ones(n, dtype=bool)
        resident, waiting, free = state
        home = resident | waiting
        if home.all() or not home.any():
            return np.ones(n, dtype=bool)
        ttft = cached_ttft(ctx, DEFAULT_BATCH_CAPACITY)
        limit = ttft.min() + HOME_SLACK_S
        spare = free & ~home
        if spare.any() and slots_abound(ctx):
            limit = min(limit, float(ttft[spare].min()))
        if ttft[home].min() <= limit:
            return home
        return np.ones(n, dtype=bool)
