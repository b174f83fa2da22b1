"""What the scheduler needs to know about one request, and nothing else.

Built by the director from the parsed body; the scheduler never sees JSON, so
scoring cost does not depend on how the request was written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_NO_BLOCKS = np.empty(0, dtype=np.uint64)


@dataclass(slots=True)
class SchedulingRequest:
    """One request to place.

    `prefix_hashes` are the chained block hashes of the prompt (one per ~64
    characters, each identifying the whole prefix up to its block); empty when
    the prompt is shorter than a block or unknown.
    """

    model: str
    adapter: str | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_hashes: np.ndarray = field(default_factory=lambda: _NO_BLOCKS)
    priority: int = 0
    sheddable: bool = False
    # Who sent it (a configured tenant's name; "" when tenants are not configured)
    # and that tenant's fair-share weight: admission orders waiters by them.
    tenant: str = ""
    tenant_weight: float = 1.0
