"""`leastRequest` (baseline profile only): prefer pods with the fewest gateway in-flight requests.

Uses only the gateway's own exact count, no scraped metric, so it is also
the degraded-mode policy when every pod's metrics are stale.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.registry import min_max_inverse, register_scorer


@register_scorer
class LeastRequest:
    name: ClassVar[str] = "leastRequest"

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        return min_max_inverse(ctx.col("inflight"))
