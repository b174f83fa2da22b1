"""Pickers: turn candidates (and their weighted totals) into an ordered choice.

Each returns positions into the candidate array: the pick first, then up to
`count - 1` distinct fallbacks Envoy tries if the first pod refuses.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from picker.scheduling.plugins import PICKERS

# Totals closer than this are a tie: scores are sums of a few ratios, so
# smaller differences are arithmetic noise, not preference.
TIE_EPSILON = 1e-9


@PICKERS.register
class MaxScore:
    """Highest total first; ties broken uniformly at random (no herding on equal pods)."""

    name: ClassVar[str] = "max-score"
    uses_scores: ClassVar[bool] = True

    def choose(self, totals: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        n = len(totals)
        keys = totals + rng.random(n) * TIE_EPSILON
        first = int(keys.argmax())
        if count <= 1 or n == 1:
            return np.array([first])
        # A few repeated argmaxes beat a partition for the ≤ 9 positions wanted.
        chosen = [first]
        for _ in range(min(count, n) - 1):
            keys[chosen[-1]] = -np.inf
            chosen.append(int(keys.argmax()))
        return np.array(chosen)


@PICKERS.register
class RoundRobin:
    """Cycle over the candidates (baseline; ignores every signal)."""

    name: ClassVar[str] = "round-robin"
    uses_scores: ClassVar[bool] = False

    def __init__(self) -> None:
        self.counter = 0

    def choose(self, totals: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        n = len(totals)
        start = self.counter % n
        self.counter += 1
        return (start + np.arange(min(count, n))) % n


@PICKERS.register
class Random:
    """Uniformly random candidates (baseline)."""

    name: ClassVar[str] = "random"
    uses_scores: ClassVar[bool] = False

    def choose(self, totals: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
        n = len(totals)
        if count <= 1:
            return np.array([int(rng.integers(n))])
        return rng.choice(n, size=min(count, n), replace=False)
