"""`queue`: prefer pods with the shortest wait queue.

q = scraped `waiting` + `dispatched` (requests the gateway sent since that
scrape, which the scrape cannot show yet). Without the correction a burst
inside one scrape interval herds onto the pod that looked emptiest; with it,
every pick immediately makes its pod look one request busier.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.registry import min_max_inverse, register_scorer


@register_scorer
class Queue:
    name: ClassVar[str] = "queue"

    def __init__(self, gap_correction: bool = True) -> None:
        self.gap_correction = gap_correction

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        q = ctx.queue_depth() if self.gap_correction else ctx.col("waiting")
        return min_max_inverse(q)
