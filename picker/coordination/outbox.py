"""The request path's side of coordination: a bounded buffer of events to publish.

The only coordination work a request does is here: one tuple appended to a
deque and, for the first event (and the first dispatch) after a flush, one
`Event.set`. Nothing
awaits, nothing talks to Redis. When the buffer is full (Redis slow or
down long enough) the oldest event is dropped and counted: an old dispatch
dropped first means the other replicas never count it, which is the safe
side (its completion, if it arrives, is ignored as unknown); a completion
dropped is covered by the other replicas' ageing (picker.coordination.replicas).

The collector's scrape results to share (picker.coordination.scrapes) wait here
too, apart from the events: only the newest per pod is kept (a newer scrape
makes an unsent one worthless), so they are bounded by the pods and never
push a dispatch or completion out of the buffer.
"""

from __future__ import annotations

import asyncio
from collections import deque

from picker.coordination.codec import COMPLETE, DISPATCH, Event, SharedScrape
from picker.datalayer.parser import MetricsSnapshot
from picker.scheduling.request import SchedulingRequest

# A pending scrape: (monotonic time of the scrape, snapshot or None when it failed, error).
_Pending = tuple[float, MetricsSnapshot | None, str]


class Outbox:
    """Events waiting for the next flush; bounded, drop-oldest."""

    __slots__ = ("_events", "_next_id", "_scrapes", "dispatch_ready", "dropped", "ready")

    def __init__(self, size: int) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self._scrapes: dict[tuple[str, str], _Pending] = {}
        self._next_id = 0
        self.dropped = 0
        # Set by the first event after a flush: wakes the flusher (see Coordinator).
        self.ready = asyncio.Event()
        # Set by the first dispatch after a flush: a dispatch waits, and its batch keeps
        # its own pace (Coordinator._gather).
        self.dispatch_ready = asyncio.Event()

    def __len__(self) -> int:
        """Events and scrape results waiting for the next flush."""
        return len(self._events) + len(self._scrapes)

    def dispatched(
        self, pool: str, address: str, req: SchedulingRequest, cached: float
    ) -> int:
        """Record a local dispatch; returns the id its completion must carry."""
        self._next_id += 1
        self._push((DISPATCH, self._next_id, pool, address, req.prompt_tokens,
                    req.max_tokens, req.adapter, cached, req.prefix_hashes, req.tenant,
                    req.tenant_weight))
        if not self.dispatch_ready.is_set():
            self.dispatch_ready.set()
        return self._next_id

    def completed(self, request_id: int, duration_s: float | None = None) -> None:
        """Record a local completion; `duration_s` (dispatch to end, this replica's clock)
        when it succeeded: the others learn the pod's speed from it."""
        self._push((COMPLETE, request_id, duration_s))

    def _push(self, event: Event) -> None:
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(event)
        if not self.ready.is_set():
            self.ready.set()

    def scraped(self, pool: str, address: str, at: float, snapshot: MetricsSnapshot | None,
                error: str) -> None:
        """A scrape to share (taken at monotonic `at`); replaces the pod's unsent one."""
        self._scrapes[(pool, address)] = (at, snapshot, error)
        if not self.ready.is_set():
            self.ready.set()

    def take_scrapes(self, now: float) -> list[SharedScrape]:
        """The scrape results to share, aged at monotonic `now`, and emptied (flusher only)."""
        out = [SharedScrape(pool, address, max(0.0, now - at), snapshot, error)
               for (pool, address), (at, snapshot, error) in self._scrapes.items()]
        self._scrapes.clear()
        return out

    def take(self) -> list[Event]:
        """Everything buffered, oldest first, and the buffer emptied (flusher only)."""
        self.ready.clear()
        self.dispatch_ready.clear()
        events = list(self._events)
        self._events.clear()
        return events
