"""`queue`: prefer pods with the shortest wait queue.

q = scraped `waiting` + `dispatched` (requests the gateway sent since that
scrape, which the scrape cannot show yet). Without the correction a burst
inside one scrape interval herds onto the pod that looked emptiest; with it,
every pick immediately makes its pod look one request busier.

Where the page has no prefill clock (SGLang, TensorRT-LLM), a request in its prefill is in
neither gauge, so q is at least the gateway's requests the scrape did not show running
(`PoolState.unseen_requests`), plus the sends since: on five SGLang A10Gs at 95 % load the
pod the tie-break chose for its short `waiting` and `running` was the one with the most
prompts still in prefill (family-2-42). Family (300 members, three seeds) p95 geometric mean
0.997 / 0.999 / 0.995, vLLM pools unchanged (docs/benchmarks.md, "The queue tie-break counts
requests in prefill").

With `latency_gated` (the llm-d profile) the score is 0 for pods whose
predicted TTFT is not within `NEAR_BEST` of the best: the queue then separates
pods of similar speed, but a pod several times slower for this request cannot
win for having one request fewer (min-max makes any difference a full point).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS, min_max_inverse
from picker.scheduling.scorers.latency import near_best


@SCORERS.register
class Queue:
    name: ClassVar[str] = "queue"

    def __init__(self, gap_correction: bool = True, latency_gated: bool = False) -> None:
        self.gap_correction = gap_correction
        self.latency_gated = latency_gated

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        if not self.gap_correction:
            q = ctx.col("waiting")
        else:  # requests in prefill are in neither gauge: see the docstring
            unseen = ctx.unseen_requests()
            q = (ctx.queue_depth() if unseen is None
                 else np.maximum(ctx.col("waiting"), unseen) + ctx.col("dispatched"))
        score = min_max_inverse(q)
        return score * near_best(ctx) if self.latency_gated else score
