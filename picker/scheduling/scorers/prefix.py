"""`prefix`: prefer pods the gateway last sent this prompt's leading blocks to.

Score = matched leading blocks / the request's blocks (0 without blocks), from
the pool's `PrefixIndex`. A pod that served the prefix most likely still has
its KV blocks cached and skips that part of the prefill.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.plugins import SCORERS


@SCORERS.register
class Prefix:
    name: ClassVar[str] = "prefix"

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        fraction = ctx.prefix_fraction()
        return 0.0 if fraction is None else fraction
