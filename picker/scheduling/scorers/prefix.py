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
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS
from picker.scheduling.scorers.latency import near_best


@SCORERS.register
class Prefix:
    name: ClassVar[str] = "prefix"

    def __init__(self, max_ttft_ratio: float = 0.0) -> None:
        self.max_ttft_ratio = max_ttft_ratio

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        fraction = ctx.prefix_fraction()
        if fraction is None:
            return 0.0
        if self.max_ttft_ratio > 0:
            return fraction * near_best(ctx, self.max_ttft_ratio)
        return fraction
