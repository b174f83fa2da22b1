"""Applying another replica's events to this replica's schedulers.

A remote dispatch goes through the same bookkeeping as a local one
(`Scheduler.on_remote_dispatch`: in-flight, dispatched since scrape,
outstanding prefill/decode tokens, since-scrape tokens, prefill backlog,
prefix index, adapter residency, pool mean sizes) except what only the origin
should count: its `picks` counter. A completion teaches the pod's speed from
the origin's own measured duration (carried in the batch), never from this
replica's view of it, which includes two flush delays. The
pod is found by pool name and address through the pool's O(1) map; a pod this
replica does not know (discovery not caught up, or a different config) is
skipped and counted. Times are this replica's: a dispatch counts from when it
was folded, so a completion's duration is measured on one clock.

A shared scrape result (the batch's `scrapes`) goes to picker.coordination.scrapes,
which writes it into the pod's row through the collector's own path, dated when
it was taken; this replica's own sends since then count again as sent
after that scrape (`PoolState.scrape_dated`: the result cannot show them). Without
scrape sharing here (`shareScrapes: false`) they are ignored: this replica
scrapes every pod itself, and its entries say so, so no other replica leaves a
pod to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from picker.coordination.codec import Batch, SharedScrape
from picker.coordination.replicas import Outstanding, Replicas
from picker.coordination.scrapes import SharedScrapes
from picker.scheduling.request import SchedulingRequest

if TYPE_CHECKING:
    from picker.director import Director


class Folder:
    """Folds decoded batches into the director's schedulers."""

    def __init__(self, director: Director, replicas: Replicas,
                 scrapes: SharedScrapes | None = None) -> None:
        self.director = director
        self.replicas = replicas
        self.scrapes = scrapes
        self.unresolved = 0  # dispatches and scrape results naming a pool or pod unknown here
        self.events = 0

    def fold(self, replica: str, batch: Batch, now: float, age_s: float) -> None:
        """Apply one batch of `replica`, received at local time `now`, `age_s` old."""
        replicas = self.replicas
        peer = replicas.heard(replica, now, age_s)
        peer.shares_scrapes = batch.shares_scrapes
        pools = self.director.datastore.pools
        schedulers = self.director.schedulers
        for d in batch.dispatches:
            pool = pools.get(d.pool)
            pod = pool.pods.get(d.address) if pool is not None else None
            sched = schedulers.get(d.pool)
            if pod is None or sched is None:
                self.unresolved += 1
                continue
            req = SchedulingRequest(
                model="",
                adapter=d.adapter,
                prompt_tokens=d.prompt_tokens,
                max_tokens=d.max_tokens,
                prefix_hashes=d.prefix_hashes,
                tenant=d.tenant,
                tenant_weight=d.tenant_weight,
            )
            sched.on_remote_dispatch(pod.row, req, now, d.cached)
            max_age = pool.config.route_timeout_s + replicas.timeout_s
            item = Outstanding(sched, sched.state, pod.row, d.address, req, now, max_age)
            replicas.add(peer, d.request_id, item, now)
        for request_id, duration in zip(batch.completions, batch.durations, strict=True):
            replicas.complete(peer, request_id, now, duration)
        self.events += len(batch.dispatches) + len(batch.completions)
        if batch.scrapes and self.scrapes is not None:
            self._fold_scrapes(self.scrapes, batch.scrapes, now, age_s)
        if batch.bye:
            replicas.leave(replica, now)

    def _fold_scrapes(self, scrapes: SharedScrapes, results: list[SharedScrape], now: float,
                      age_s: float) -> None:
        pools = self.director.datastore.pools
        for result in results:
            pool = pools.get(result.pool)
            pod = pool.pods.get(result.address) if pool is not None else None
            if pod is None:
                self.unresolved += 1
                continue
            at = scrapes.received(pool, pod, result, now, age_s)
            sched = self.director.schedulers.get(result.pool)
            if at is not None and result.snapshot is not None and sched is not None:
                sched.state.scrape_dated(pod.row, at)
