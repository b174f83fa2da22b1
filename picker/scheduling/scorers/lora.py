"""`loraAffinity`: prefer pods that already hold the request's LoRA adapter.

1.0 adapter resident (running), 0.8 a free adapter slot, 0.6 adapter only
queued (waiting) there, else 0; 1.0 everywhere for base-model requests.
A pod that publishes no LoRA information (max_lora == 0) scores 0.8, like a
free slot: it can probably load the adapter, but nothing shows it already has
it, so a pod known to hold it still wins.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.context import ScoringContext
from picker.scheduling.filters import lora_state
from picker.scheduling.plugins import SCORERS

RESIDENT = 1.0
FREE_SLOT = 0.8
WAITING = 0.6


@SCORERS.register
class LoraAffinity:
    name: ClassVar[str] = "loraAffinity"

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        state = lora_state(ctx)
        if state is None:
            return RESIDENT
        resident, waiting, free = state
        return np.where(
            resident, RESIDENT, np.where(free, FREE_SLOT, np.where(waiting, WAITING, 0.0))
        )
