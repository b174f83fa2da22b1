"""Scrape outcome counters, for the gateway's own Prometheus metrics.

Plain numbers kept by the collectors; the gateway's metrics module reads
them when it is scraped. Bounded: a pod's entry is dropped when it leaves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class PodScrapeStats:
    """Totals for one pod since it joined."""

    ok: int = 0
    failed: int = 0
    last_duration_s: float = 0.0
    last_error: str = ""


class ScrapeCounters:
    """Scrapes ok / failed and last scrape duration, per (pool name, pod address)."""

    def __init__(self) -> None:
        self._pods: dict[tuple[str, str], PodScrapeStats] = {}
        self.ok_total = 0
        self.failed_total = 0

    def record(self, pool: str, address: str, ok: bool, duration_s: float,
               error: str = "") -> None:
        stats = self._pods.get((pool, address))
        if stats is None:
            stats = self._pods[(pool, address)] = PodScrapeStats()
        stats.last_duration_s = duration_s
        if ok:
            stats.ok += 1
            stats.last_error = ""
            self.ok_total += 1
        else:
            stats.failed += 1
            stats.last_error = error
            self.failed_total += 1

    def forget(self, pool: str, address: str) -> None:
        self._pods.pop((pool, address), None)

    def forget_pool(self, pool: str) -> None:
        for key in [k for k in self._pods if k[0] == pool]:
            del self._pods[key]

    def get(self, pool: str, address: str) -> PodScrapeStats | None:
        return self._pods.get((pool, address))

    def items(self) -> Iterator[tuple[str, str, PodScrapeStats]]:
        """(pool, address, stats) for every pod currently tracked."""
        for (pool, address), stats in list(self._pods.items()):
            yield pool, address, stats

    def __len__(self) -> int:
        return len(self._pods)
