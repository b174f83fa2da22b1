"""Shared scrape results: each pod is scraped by one live replica, which shares the numbers.

Without sharing, N coordinated replicas scrape every pod N times as often as one
would (docs/benchmarks.md, Scraping: 77 scrapes/s per pod at N = 4, and a real
vLLM renders its page on its serving loop). With it (`shareScrapes`, the default):

- Ownership: each pod has one owner among the live replicas that share their
  scrapes (this one included, as picker.coordination.replicas hears them; one
  configured `shareScrapes: false` says so in its entries), chosen by rendezvous
  (highest-random-weight) hashing of (pod address, replica id). Every replica
  computes the same owner from the same live set without talking about it, and
  a replica that joins or leaves moves only the pods it takes or held (about
  1/N of them), so a change of the set never reshuffles the rest.
- The owner scrapes as before and puts each outcome (the parsed snapshot, or
  the failure) in the outbox: it leaves with the next flush.
- The others fold it through the collector's own path (`apply_shared`: the
  columns, the speed learner, `mark_scrape`) dated by its age: the owner's
  monotonic age at send plus the entry's transit by the wall clocks (hosts are
  assumed NTP-synchronised: a skew shifts the age by the skew). A result older
  than the row's last outcome is not written (a row only moves forward: the
  speed learner reads counter growth between two scrapes).
- A non-owner skips its own scrape of a pod while the owner's results are
  fresh: the newest is at most two expected gaps old (the interval; while the
  pod fails, the owner's backoff plus the scrape timeout) plus a flushInterval.
  Otherwise (owner dead or slow, Redis down, the replicas' views of the set
  differing) it scrapes the pod itself at its next tick, so routing never goes
  blind; with the link down every pod is scraped here, as without coordination.
  Only the owner publishes: fallback scrapes stay local (two fallbacks sharing
  would each suppress the other's scraping in turn).

Nothing here runs per request: the collector's per-pod task asks
`should_scrape` once per interval, and a pod's owner is cached until the live
set changes (looked at every MEMBERS_REFRESH_S at most).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from contract.config import MetricsConfig
from picker.coordination.codec import SharedScrape
from picker.coordination.outbox import Outbox
from picker.coordination.replicas import Replicas
from picker.datalayer.collector import MetricsCollector, backoff_delay
from picker.datalayer.parser import MetricsSnapshot
from picker.datastore import Pod, Pool

log = logging.getLogger("picker.coordination")

# A shared result is fresh for this many expected gaps between two of them (+ a flush).
FRESH_GAPS = 2.0
# How stale the cached live set may be: ownership follows a change this fast.
MEMBERS_REFRESH_S = 0.05
MAX_CACHED_OWNERS = 100_000
# The per-pod table is pruned of departed pods when it grows past twice its size plus this.
PRUNE_SLACK = 1024

# Who scrapes a pod for this replica (what `igw status` and the metrics count).
OWNER = "owner"  # this replica, and it shares the results
SHARED = "shared"  # its owner, another replica; this one folds the results
FALLBACK = "fallback"  # this replica, though another owns it: no fresh results from there
ROLES = (OWNER, SHARED, FALLBACK)


def weight(key: str, replica: str) -> int:
    """`replica`'s rendezvous weight for `key`: 64 bits of BLAKE2b, the same on every host
    (never Python's `hash`, which is salted per process)."""
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(key: str, members: Iterable[str]) -> str:
    """The member with the highest weight for `key` (ties, never seen, by name)."""
    return max(members, key=lambda m: (weight(key, m), m))


class Ownership:
    """The owner of each pod address among one replica set, cached until the set changes."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.members: tuple[str, ...] = (me,)
        self._owners: dict[str, str] = {}

    def set_members(self, members: Iterable[str]) -> bool:
        """The live set (this replica is always in it); True when it changed."""
        new = tuple(sorted({self.me, *members}))
        if new == self.members:
            return False
        self.members = new
        self._owners.clear()
        return True

    def owner(self, address: str) -> str:
        found = self._owners.get(address)
        if found is None:
            if len(self._owners) >= MAX_CACHED_OWNERS:
                self._owners.clear()
            found = self._owners[address] = owner(address, self.members)
        return found


@dataclass(slots=True)
class _PodShare:
    """What this replica knows of one pod's shared scraping (local monotonic times)."""

    written_at: float = -math.inf  # the row's newest outcome, own scrape or shared
    shared_at: float = -math.inf  # scrape time of the newest shared result received
    shared_failures: int = 0  # consecutive failed shared results: the owner backs off
    role: str = OWNER


@dataclass(slots=True)
class ScrapeShareStats:
    """Counters for metrics and `igw status` (the results sent are the coordinator's)."""

    received: int = 0  # shared results for pods known here
    used: int = 0  # written into the row
    ignored: int = 0  # not written: older than the row's last outcome, or a pod owned here
    skipped: int = 0  # own scrapes not made: a fresh shared result covered the pod
    fallbacks: int = 0  # own scrapes of a pod another replica owns (no fresh results)


class SharedScrapes:
    """The collector's `ScrapeSharing` while coordinated: ownership, freshness, folding."""

    def __init__(self, me: str, replicas: Replicas, outbox: Outbox, collector: MetricsCollector,
                 connected: Callable[[], bool], flush_interval_s: float) -> None:
        self.ownership = Ownership(me)
        self.replicas = replicas
        self.outbox = outbox
        self.collector = collector
        self.connected = connected
        self.flush_interval_s = flush_interval_s
        self.stats = ScrapeShareStats()
        self._pods: dict[tuple[str, str], _PodShare] = {}
        self._prune_at = PRUNE_SLACK
        self._members_at = -math.inf

    def attach(self) -> None:
        """The collector asks this one from now on."""
        self.collector.sharing = self

    def detach(self) -> None:
        """The collector scrapes every pod itself again."""
        if self.collector.sharing is self:
            self.collector.sharing = None

    # -- the collector's side (ScrapeSharing) ------------------------------------------

    def should_scrape(self, pool: Pool, pod: Pod, now: float) -> bool:
        share = self._share(pool.name, pod.address)
        if self._owns(pod.address, now):
            share.role = OWNER
            return True
        if self.connected() and self._fresh(share, pool.config.metrics, now):
            share.role = SHARED
            self.stats.skipped += 1
            return False
        if share.role != FALLBACK:
            log.debug("coordination scrape fallback pool=%s pod=%s owner=%s",
                      pool.name, pod.address, self.ownership.owner(pod.address))
        share.role = FALLBACK
        self.stats.fallbacks += 1
        return True

    def scraped(self, pool: Pool, pod: Pod, snapshot: MetricsSnapshot | None, error: str,
                now: float) -> None:
        share = self._share(pool.name, pod.address)
        share.written_at = max(share.written_at, now)
        if share.role == OWNER and len(self.ownership.members) > 1 and self.connected():
            self.outbox.scraped(pool.name, pod.address, now, snapshot, error)

    def forget(self, pool: str, address: str) -> None:
        self._pods.pop((pool, address), None)

    # -- the fold's side ---------------------------------------------------------------

    def received(self, pool: Pool, pod: Pod, result: SharedScrape, now: float,
                 transit_s: float) -> float | None:
        """Another replica's result for `pod`, folded at local monotonic `now`, its entry
        `transit_s` old by the wall clocks; the local time it was taken at when it was
        written into the row, else None."""
        self.stats.received += 1
        if pool.config.metrics.source != "scrape" or self._owns(pod.address, now):
            self.stats.ignored += 1  # this replica reads the pod itself
            return None
        at = now - result.age_s - transit_s
        share = self._share(pool.name, pod.address)
        if at > share.shared_at:
            share.shared_at = at
            share.shared_failures = 0 if result.snapshot is not None else (
                share.shared_failures + 1)
        if at <= share.written_at:
            self.stats.ignored += 1
            return None
        share.written_at = at
        self.collector.apply_shared(pool, pod, result.snapshot, at)
        self.stats.used += 1
        return at

    # -- reading -----------------------------------------------------------------------

    def roles(self) -> dict[str, int]:
        """How many pods each role covers (OWNER, SHARED, FALLBACK), as last decided."""
        counts = Counter(share.role for share in self._pods.values())
        return {role: counts.get(role, 0) for role in ROLES}

    # -- internals ---------------------------------------------------------------------

    def _share(self, pool: str, address: str) -> _PodShare:
        share = self._pods.get((pool, address))
        if share is None:
            if len(self._pods) >= self._prune_at:
                self._prune()
            share = self._pods[(pool, address)] = _PodShare()
        return share

    def _prune(self) -> None:
        """Drop pods gone from the datastore. The collector forgets the pods it scraped
        when they leave; this catches one that left before its scrape task started (a
        result for it came in between), so the table stays within twice the pods."""
        pools = self.collector.datastore.pools
        self._pods = {key: share for key, share in self._pods.items()
                      if (pool := pools.get(key[0])) is not None and key[1] in pool.pods}
        self._prune_at = 2 * len(self._pods) + PRUNE_SLACK

    def _owns(self, address: str, now: float) -> bool:
        if now - self._members_at >= MEMBERS_REFRESH_S:
            self._members_at = now
            if self.ownership.set_members(self.replicas.scrape_owners(now)):
                log.debug("coordination scrape owners recomputed replicas=%s",
                          ",".join(self.ownership.members))
        return self.ownership.owner(address) == self.ownership.me

    def _fresh(self, share: _PodShare, metrics: MetricsConfig, now: float) -> bool:
        """The newest shared result is recent enough that the next is not overdue."""
        failures = share.shared_failures
        gap = backoff_delay(metrics, failures, self.collector.options)
        if failures:
            gap += metrics.timeout_s  # a failing pod may hang each scrape until its timeout
        return now - share.shared_at <= FRESH_GAPS * gap + self.flush_interval_s
