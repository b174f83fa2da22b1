"""`leastRequest` (baseline profile only): prefer pods with the fewest gateway in-flight requests.

Uses only the gateway's own exact count, no scraped metric, so it is also
the degraded-mode policy when every pod's metrics are stale. Registered as
internal: it is the `least-request` profile and degraded mode, not a weight a
config may give (it is not in `contract.config.WEIGHT_NAMES`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS, min_max_inverse


@SCORERS.register_internal
class LeastRequest:
    name: ClassVar[str] = "leastRequest"

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        return min_max_inverse(ctx.col("inflight"))
