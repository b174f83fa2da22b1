"""The scheduling plugins: their interfaces, and one registry per kind, keyed by type name.

A filter narrows the candidate pods; a scorer gives every candidate a score
in [0, 1]; a picker turns weighted totals into an ordered choice. Each plugin
class registers itself under its `name` (`@SCORERS.register`), so a profile
is a table of names (filters, scorer weights, picker) that `build_profile`
resolves once per (re)configuration, never per request. Scorer names are the
config's weight names, except scorers registered with `register_internal`,
which only the built-in profiles use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Generic, Protocol, TypeVar

import numpy as np

from picker.datastore import Pool
from picker.scheduling.context import ScoringContext


class Filter(Protocol):
    """Keeps the candidates that may serve the request."""

    name: ClassVar[str]
    # Reason recorded (explain, NoCandidates) for a pod this filter drops.
    reason: ClassVar[str]
    # True: when the filter would drop every candidate, keep its `fallback(ctx)`
    # mask instead and route in degraded mode rather than fail (see FreshMetrics).
    degrade_when_empty: ClassVar[bool]

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        """Boolean mask over `ctx.rows`."""
        ...


class PodFilter:
    """A filter that does not depend on the request: one mask over the whole table.

    The scheduler ANDs these masks over the full columns in one pass (cheaper
    than narrowing the candidates filter by filter) and only walks them one
    by one when it needs reasons (explain) or a fallback.
    """

    name: ClassVar[str]
    reason: ClassVar[str]
    degrade_when_empty: ClassVar[bool] = False

    def mask(self, pool: Pool, now: float) -> np.ndarray:
        """Boolean over every table row."""
        raise NotImplementedError

    def keep(self, ctx: ScoringContext) -> np.ndarray:
        return self.mask(ctx.pool, ctx.now)[ctx.rows]

    def fallback(self, ctx: ScoringContext) -> np.ndarray:
        """Who may still be routed to, degraded, when this filter would drop everyone."""
        return np.ones(len(ctx.rows), dtype=bool)


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better."""

    name: ClassVar[str]

    def score(self, ctx: ScoringContext) -> np.ndarray | float:
        """float64 array aligned with `ctx.rows`, or one float when every candidate
        scores the same (saves building an array that cannot change the pick)."""
        ...


class Picker(Protocol):
    """Turns the weighted totals into the pick and its fallbacks."""

    name: ClassVar[str]
    # False: the scheduler skips scoring and passes zeros (the baselines).
    uses_scores: ClassVar[bool]

    def choose(self, totals: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        """Positions of the chosen candidates, best first (at most `count`, distinct)."""
        ...


class UnknownPlugin(ValueError):
    """A profile or a weight names a plugin nobody registered."""


class DuplicatePlugin(ValueError):
    """Two plugins of one kind claim the same name: the second would silently win."""


P = TypeVar("P")
C = TypeVar("C", bound=type)


class Registry(Generic[P]):
    """The plugin classes of one kind, by type name, in registration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[P]] = {}
        self._internal: set[str] = set()

    def register(self, cls: C) -> C:
        """Class decorator: make `cls` available under its `name`, which must be new."""
        name: str = cls.name  # type: ignore[attr-defined]
        taken = self._classes.get(name)
        if taken is not None:
            raise DuplicatePlugin(
                f"{self.kind} {name!r} registered twice: {_where(taken)} and {_where(cls)}"
            )
        self._classes[name] = cls
        return cls

    def register_internal(self, cls: C) -> C:
        """`register` for a plugin only the built-in profiles use: no config may name
        it, so `public_names` leaves it out (a scorer so registered is no weight name)."""
        self.register(cls)
        self._internal.add(cls.name)  # type: ignore[attr-defined]
        return cls

    def __getitem__(self, name: str) -> type[P]:
        cls = self._classes.get(name)
        if cls is None:
            raise UnknownPlugin(f"unknown {self.kind} {name!r}; known: {', '.join(self)}")
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def public_names(self) -> tuple[str, ...]:
        """Names a config may use: for scorers, exactly `contract.config.WEIGHT_NAMES`."""
        return tuple(n for n in self._classes if n not in self._internal)


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


FILTERS: Registry[Filter] = Registry("filter")
SCORERS: Registry[Scorer] = Registry("scorer")
PICKERS: Registry[Picker] = Registry("picker")


def min_max_inverse(values: np.ndarray) -> np.ndarray | float:
    """(max − v) / (max − min): 1 for the lowest value, 0 for the highest, 1 when all equal.

    The Scorer contract's normalization for counts (queue, running, recency):
    it maps any pool's range onto [0, 1], so weights mean the same at any scale.
    """
    lo = values.min()
    hi = values.max()
    span = hi - lo
    if span <= 0:
        return 1.0
    return (hi - values) / span
