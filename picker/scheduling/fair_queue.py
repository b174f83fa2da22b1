"""The order in which held requests leave the gateway: bands, then fair shares, then FCFS.

Priority bands first: a waiter of a higher priority always leaves before any
of a lower one. Within a band, tenants share by weight with self-clocked fair
queuing: each waiter gets a finish tag, its tenant's previous tag (or the
band's virtual time, if later: an idle tenant banks no credit) plus its cost
over the tenant's weight, and the smallest tag leaves first; the band's
virtual time is the tag of the last one to leave. A tenant offering ten
times its share therefore waits behind its own backlog, while another tenant
keeps its weighted share of every release. Within a tenant tags only grow,
so it is first come, first served. When the queue is full, a newcomer
displaces the newest waiter of the lowest band, or of its own band's tenant
furthest past its share (the largest finish tag), rather than being refused
itself: a tenant that fills the queue cannot lock the others out of it.
Cost is the request's prompt tokens (work, not counts: a tenant of long
prompts does not get more prefill by sending fewer, bigger requests).

One heap over every band: push, pop and remove are O(log n). Removal is lazy
(a flag, compacted when dead entries pass the live ones), and per-tenant tags
are dropped once a tenant has nothing queued and no lead over the band, so
memory follows what is queued, not what was ever seen.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

MIN_WEIGHT = 1e-3


class Entry(Generic[T]):
    """One queued item and its place in the order."""

    __slots__ = ("finish", "item", "priority", "removed", "start", "tenant")

    def __init__(self, item: T, priority: int, tenant: str, start: float, finish: float) -> None:
        self.item = item
        self.priority = priority
        self.tenant = tenant
        self.start = start
        self.finish = finish
        self.removed = False


class _Band:
    """Per-priority fair-queuing clock, each tenant's latest finish tag, and each
    tenant's entries in arrival order (dead ones skipped lazily)."""

    __slots__ = ("entries", "live", "queued", "tags", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.live = 0
        self.tags: dict[str, float] = {}
        self.queued: dict[str, int] = {}
        self.entries: dict[str, deque[Entry]] = {}


class FairQueue(Generic[T]):
    """Priority bands, weighted fair shares between tenants within a band, FCFS within one."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Entry[T]]] = []
        self._seq = itertools.count()
        self._bands: dict[int, _Band] = {}
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @property
    def heap_size(self) -> int:
        """Entries held, dead ones included (bounded by `_compact`)."""
        return len(self._heap)

    def push(self, item: T, priority: int, tenant: str = "", weight: float = 1.0,
             cost: float = 1.0) -> Entry[T]:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
        start = max(band.vtime, band.tags.get(tenant, 0.0))
        finish = start + _span(weight, cost)
        band.tags[tenant] = finish
        band.queued[tenant] = band.queued.get(tenant, 0) + 1
        band.live += 1
        self._live += 1
        entry = Entry(item, priority, tenant, start, finish)
        band.entries.setdefault(tenant, deque()).append(entry)
        heapq.heappush(self._heap, (-priority, finish, next(self._seq), entry))
        return entry

    def displace(self, priority: int, tenant: str = "", weight: float = 1.0,
                 cost: float = 1.0) -> T | None:
        """Make room for a newcomer when the queue is full: take out and return the
        newest entry of the lowest band below `priority`, or, in its own band, of the
        tenant furthest past its share if that is further than the newcomer would be.
        None: the newcomer is the one to refuse."""
        if not self._bands:
            return None
        lowest = min(self._bands)
        if lowest > priority:
            return None
        band = self._bands[lowest]
        victim = max(band.queued, key=lambda t: band.tags.get(t, 0.0))
        if lowest == priority:
            mine = max(band.vtime, band.tags.get(tenant, 0.0)) + _span(weight, cost)
            if victim == tenant or band.tags.get(victim, 0.0) <= mine:
                return None
        newest = band.entries[victim]
        while newest[-1].removed:
            newest.pop()
        entry = newest.pop()
        band.tags[victim] = entry.start  # it never queued: its share is not spent
        self.remove(entry)
        return entry.item

    def peek(self) -> Entry[T] | None:
        """The next entry to leave, or None."""
        heap = self._heap
        while heap and heap[0][3].removed:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def peek_excluding(self, skip: set[str]) -> Entry[T] | None:
        """The next entry to leave among tenants not in `skip` (those at their share of
        the pool's slots, picker.scheduling.shares), or None. Within a band a tenant's
        oldest entry has its smallest tag, so this looks at one entry per tenant
        queued: O(tenants queued), only when the heap's head is skipped."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            best: Entry[T] | None = None
            for tenant, waiting in band.entries.items():
                if tenant in skip:
                    continue
                while waiting and waiting[0].removed:
                    waiting.popleft()
                if waiting and (best is None or waiting[0].finish < best.finish):
                    best = waiting[0]
            if best is not None:
                return best
        return None

    def tenants(self) -> set[str]:
        """Tenants with an entry queued, in any band."""
        return {t for band in self._bands.values() for t in band.queued}

    def pop(self) -> T:
        """Take the next entry out (the queue must not be empty); it advances its band's clock."""
        entry = self.peek()
        if entry is None:
            raise IndexError("pop from an empty FairQueue")
        heapq.heappop(self._heap)
        return self._take(entry)

    def take(self, entry: Entry[T]) -> T:
        """Take out `entry` (from `peek_excluding`) as if popped: it advances its band's
        clock. Its heap slot is left dead (bounded by `_compact`)."""
        item = self._take(entry)
        if len(self._heap) > 2 * self._live + 32:
            self._compact()
        return item

    def _take(self, entry: Entry[T]) -> T:
        band = self._bands[entry.priority]
        band.vtime = max(band.vtime, entry.finish)
        oldest = band.entries[entry.tenant]
        while oldest and (oldest[0].removed or oldest[0] is entry):
            oldest.popleft()
        self._leave(entry, band)
        return entry.item

    def remove(self, entry: Entry[T]) -> None:
        """Take `entry` out wherever it is (its waiter gave up); idempotent."""
        if entry.removed:
            return
        entry.removed = True
        self._leave(entry, self._bands[entry.priority])
        if len(self._heap) > 2 * self._live + 32:
            self._compact()

    def items(self) -> list[T]:
        """Every live item, in no particular order."""
        return [e[3].item for e in self._heap if not e[3].removed]

    def clear(self) -> None:
        for e in self._heap:
            e[3].removed = True
        self._heap.clear()
        self._bands.clear()
        self._live = 0

    def _leave(self, entry: Entry[T], band: _Band) -> None:
        entry.removed = True
        self._live -= 1
        band.live -= 1
        tenant = entry.tenant
        left = band.queued[tenant] - 1
        if left:
            band.queued[tenant] = left
            waiting = band.entries[tenant]
            if len(waiting) > 2 * left + 16:
                band.entries[tenant] = deque(e for e in waiting if not e.removed)
        else:
            del band.queued[tenant]
            del band.entries[tenant]
            if band.tags.get(tenant, 0.0) <= band.vtime:
                band.tags.pop(tenant, None)
        if not band.live:
            del self._bands[entry.priority]  # an empty band restarts its clock: nothing owed
        elif len(band.tags) > 2 * len(band.queued) + 64:
            band.tags = {t: band.tags[t] for t in band.queued}

    def _compact(self) -> None:
        """Bound the dead entries cancelled waiters leave in the heap."""
        self._heap = [e for e in self._heap if not e[3].removed]
        heapq.heapify(self._heap)


def _span(weight: float, cost: float) -> float:
    """Virtual time one entry takes: its cost over its tenant's weight."""
    return max(cost, 1.0) / max(weight, MIN_WEIGHT)
