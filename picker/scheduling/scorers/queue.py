"""`queue`: prefer pods with the shortest wait queue.

q = scraped `waiting` + `dispatched` (requests the gateway sent since that
scrape, which the scrape cannot show yet). Without the correction a burst
inside one scrape interval herds onto the pod that looked emptiest; with it,
every pick immediately makes its pod look one request busier.

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
        q = ctx.queue_depth() if self.gap_correction else ctx.col("waiting")
        score = min_max_inverse(q)
        return score * near_best(ctx) if self.latency_gated else score
