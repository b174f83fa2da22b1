"""`kvCache`: prefer pods with free KV-cache memory (1 − usage).

With the gap correction, prompt tokens the gateway sent since the pod's last
scrape are added as KV usage, as a fraction of the pod's KV capacity in tokens
(`kv_num_blocks` × `kv_block_size`, from `vllm:cache_config_info`); a pod that
does not publish its cache size keeps the scraped usage as is.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS


@SCORERS.register
class KvCache:
    name: ClassVar[str] = "kvCache"

    def __init__(self, gap_correction: bool = True) -> None:
        self.gap_correction = gap_correction

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        usage = ctx.col("kv_usage")
        since = ctx.since_scrape_tokens() if self.gap_correction else None
        if since is None:
            return 1.0 - usage  # the collector keeps kv_usage within [0, 1]
        cap = ctx.col("kv_num_blocks") * ctx.col("kv_block_size")
        extra = np.divide(since, cap, out=np.zeros(len(cap)), where=cap > 0)
        score = 1.0 - usage - extra
        np.maximum(score, 0.0, out=score)
        return score
