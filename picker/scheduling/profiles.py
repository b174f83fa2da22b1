"""Scheduler profiles: which filters, which scorers with which weights, which picker.

A profile is data: plugin type names (see `plugins`), resolved through the
registries by `build_profile` when a pool is (re)configured, so the request
path holds plugin instances and never looks a name up. The config's
`scheduler` field names a profile; the config's `weights` then override (or
add to) that profile's weights, and a weight of 0 removes a scorer. See
docs/scoring.md for why the llm-d weights are what they are, and
docs/extending.md for adding a plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from contract.config import SchedulerConfig
from picker.scheduling import filters as _filters  # noqa: F401  (registers the filters)
from picker.scheduling import lora_home as _lora_home  # noqa: F401  (registers lora-home)
from picker.scheduling import pickers as _pickers  # noqa: F401  (registers the pickers)
from picker.scheduling import scorers as _scorers  # noqa: F401  (registers the scorers)
from picker.scheduling.plugins import FILTERS, PICKERS, SCORERS, Filter, Picker, Scorer

DEFAULT_PROFILE = "llm-d"

_SERVING: tuple[str, ...] = ("ready", "not-draining", "fresh-metrics")
# flow-room: it sends a request admission released to a pod with room
# (picker.scheduling.flow), among the pods the filters before it kept; lora-home
# (ours) then keeps an adapter's homes among those (docs/benchmarks.md "Kept: lora-home").
BASE_FILTERS: tuple[str, ...] = (*_SERVING, "flow-room")
# The reference picker's: no lora-home.
EPP_FILTERS: tuple[str, ...] = (*_SERVING, "lora", "flow-room")
SCORING_FILTERS: tuple[str, ...] = (*EPP_FILTERS, "lora-home")


@dataclass(frozen=True)
class ProfileSpec:
    """A profile as data; `build_profile` turns it into plugin instances."""

    weights: Mapping[str, float]
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Filter names, in order (the first that drops a pod names the reason).
    filters: tuple[str, ...] = SCORING_FILTERS
    picker: str = "max-score"
    # Baselines ignore the config's weights: they exist to be compared against.
    accepts_weights: bool = True


PROFILES: dict[str, ProfileSpec] = {
    # Ours: expected TTFT leads; prefix keeps caches warm beyond this request (on pods
    # within 4x the best predicted TTFT, and not on one far busier than a pod of its size);
    # queue and KV (with the in-flight correction) guard against what the TTFT
    # model cannot see (preemption under KV pressure); LoRA affinity avoids
    # adapter swaps; lru and running requests break near-ties towards spreading.
    "llm-d": ProfileSpec(
        weights={
            "predictedLatency": 3.0,
            "prefix": 4.5,
            "queue": 1.0,
            "kvCache": 1.0,
            "loraAffinity": 1.0,
            "runningRequests": 0.5,
            "lru": 0.5,
        },
        params={
            "prefix": {"max_ttft_ratio": 4.0, "ample_cache": 0.1, "balance": 2.0},
            "queue": {"latency_gated": True},
            "runningRequests": {"latency_gated": True},
            "lru": {"latency_gated": True},
        },
    ),
    # The reference endpoint picker's published defaults, on scraped numbers
    # only (no in-flight correction), so it can be compared as published.
    "epp": ProfileSpec(
        weights={"queue": 2.0, "kvCache": 2.0, "prefix": 3.0},
        filters=EPP_FILTERS,
        params={
            "queue": {"gap_correction": False},
            "kvCache": {"gap_correction": False},
            "runningRequests": {"gap_correction": False},
        },
    ),
    "least-request": ProfileSpec(
        weights={"leastRequest": 1.0}, filters=BASE_FILTERS, accepts_weights=False
    ),
    "round-robin": ProfileSpec(
        weights={}, filters=BASE_FILTERS, picker="round-robin", accepts_weights=False
    ),
    "random": ProfileSpec(weights={}, filters=BASE_FILTERS, picker="random", accepts_weights=False),
}


@dataclass(frozen=True)
class Profile:
    """Plugin instances of one pool's scheduler."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker

    @property
    def weights(self) -> dict[str, float]:
        return {scorer.name: weight for scorer, weight in self.scorers}

    @cached_property
    def weight_vector(self) -> np.ndarray:
        return np.array([weight for _, weight in self.scorers])


def effective_weights(name: str, user: Mapping[str, float] | None = None) -> dict[str, float]:
    """The profile's weights with the user's on top; zero weights dropped."""
    spec = PROFILES[name]
    weights = dict(spec.weights)
    if user and spec.accepts_weights:
        weights.update(user)
    return {k: float(v) for k, v in weights.items() if v > 0}


def build_profile(
    name: str = DEFAULT_PROFILE, user_weights: Mapping[str, float] | None = None
) -> Profile:
    """Instantiate profile `name` with the user's weight overrides; an unknown
    profile, filter, scorer or picker name raises ValueError naming the known ones."""
    if name not in PROFILES:
        raise ValueError(f"unknown scheduler profile {name!r}; known: {', '.join(PROFILES)}")
    spec = PROFILES[name]
    scorers = tuple(
        (SCORERS[scorer](**spec.params.get(scorer, {})), weight)
        for scorer, weight in effective_weights(name, user_weights).items()
    )
    return Profile(
        name=name,
        filters=tuple(FILTERS[f]() for f in spec.filters),
        scorers=scorers,
        picker=PICKERS[spec.picker](),
    )


def profile_for(config: SchedulerConfig) -> Profile:
    return build_profile(config.scheduler, config.weights)
