"""`runningRequests`: prefer pods decoding fewer requests (less decode contention).

r = scraped `running` + `dispatched` since that scrape. Not `running +
inflight`: the gateway's in-flight requests are mostly already inside
`running`, so adding them would count each one twice.

`latency_gated`: 0 for pods not near the best predicted TTFT, as for `queue`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS, min_max_inverse
from picker.scheduling.scorers.latency import near_best


@SCORERS.register
class RunningRequests:
    name: ClassVar[str] = "runningRequests"

    def __init__(self, gap_correction: bool = True, latency_gated: bool = False) -> None:
        self.gap_correction = gap_correction
        self.latency_gated = latency_gated

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        r = ctx.col("running")
        if self.gap_correction:
            r = r + ctx.col("dispatched")
        score = min_max_inverse(r)
        return score * near_best(ctx) if self.latency_gated else score
