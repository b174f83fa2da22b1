"""`lru`: spread requests that have no cache affinity over the least recently picked pods.

When no candidate matches the request's prefix, 1 for the pod picked longest
ago and 0 for the one picked last (min-max on `last_picked_at`), so new
prefixes land on different pods and the cache of the pool holds more of them.
When some pod has a prefix hit, every pod scores 0: the scorer then has no
effect and cannot pull the request away from its cache.

`latency_gated` (the llm-d profile): 0 for pods whose predicted TTFT is not
within `NEAR_BEST` of the best. On a mixed fleet the least recently picked
pods are the slow ones (the latency model keeps traffic off them), so plain
recency would keep voting for them.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS, min_max_inverse
from picker.scheduling.scorers.latency import near_best


@SCORERS.register
class Lru:
    name: ClassVar[str] = "lru"

    def __init__(self, latency_gated: bool = False) -> None:
        self.latency_gated = latency_gated

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        if ctx.prefix_matched() is not None:
            return 0.0
        score = min_max_inverse(ctx.col("last_picked_at"))
        return score * near_best(ctx) if self.latency_gated else score
