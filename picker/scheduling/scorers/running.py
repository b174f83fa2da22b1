"""`runningRequests`: prefer pods decoding fewer requests (less decode contention).

r = scraped `running` + `dispatched` since that scrape. Not `running +
inflight`: the gateway's in-flight requests are mostly already inside
`running`, so adding them would count each one twice.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.registry import min_max_inverse, register_scorer


@register_scorer
class RunningRequests:
    name: ClassVar[str] = "runningRequests"

    def __init__(self, gap_correction: bool = True) -> None:
        self.gap_correction = gap_correction

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        r = ctx.col("running")
        if self.gap_correction:
            r = r + ctx.col("dispatched")
        return min_max_inverse(r)
