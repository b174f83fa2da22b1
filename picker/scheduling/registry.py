"""Plugin interfaces and the registries that let the config name plugins by type.

A filter narrows the candidate pods; a scorer gives every candidate a score
in [0, 1]; a picker turns weighted totals into an ordered choice. Scorers are
registered under the config's weight names (`queue`, `kvCache`, ...), so a
profile is just a table of names and weights.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from picker.scheduling.context import ScoringContext


class Filter(Protocol):
    """Keeps the candidates that may serve the request."""

    name: ClassVar[str]
    # Reason recorded (explain, NoCandidates) for a pod this filter drops.
    reason: ClassVar[str]
    # True: when the filter would drop every candidate, keep them all and route
    # in degraded mode instead of failing (see filters.FreshMetrics).
    degrade_when_empty: ClassVar[bool]

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        """Boolean mask over `ctx.rows`."""
        ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better."""

    name: ClassVar[str]

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        """float64 array aligned with `ctx.rows`, or one float when every candidate
        scores the same (saves building an array that cannot change the pick)."""
        ...


SCORERS: dict[str, type[Any]] = {}
FILTERS: dict[str, type[Any]] = {}

T = TypeVar("T", bound=type)


def register_scorer(cls: T) -> T:
    """Class decorator: make a scorer available under its `name`."""
    SCORERS[cls.name] = cls  # type: ignore[attr-defined]
    return cls


def register_filter(cls: T) -> T:
    """Class decorator: make a filter available under its `name`."""
    FILTERS[cls.name] = cls  # type: ignore[attr-defined]
    return cls


def min_max_inverse(values: np.ndarray) -> np.ndarray | float:
    """(max − v) / (max − min): 1 for the lowest value, 0 for the highest, 1 when all equal."""
    lo = values.min()
    hi = values.max()
    span = hi - lo
    if span <= 0:
        return 1.0
    return (hi - values) / span
