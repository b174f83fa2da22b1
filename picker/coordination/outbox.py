"""The request path's side of coordination: a bounded buffer of events to publish.

The only coordination work a request does is here: one tuple appended to a
deque and, for the first event after a flush, one `Event.set`. Nothing
awaits, nothing talks to Redis. When the buffer is full (Redis slow or
down long enough) the oldest event is dropped and counted: an old dispatch
dropped first means the other replicas never count it, which is the safe
side (its completion, if it arrives, is ignored as unknown); a completion
dropped is covered by the other replicas' ageing (picker.coordination.replicas).
"""

from __future__ import annotations

import asyncio
from collections import deque

from picker.coordination.codec import COMPLETE, DISPATCH, Event
from picker.scheduling.request import SchedulingRequest


class Outbox:
    """Events waiting for the next flush; bounded, drop-oldest."""

    __slots__ = ("_events", "_next_id", "dropped", "ready")

    def __init__(self, size: int) -> None:
        self._events: deque[Event] = deque(maxlen=size)
        self._next_id = 0
        self.dropped = 0
        # Set by the first event after a flush: wakes the flusher (see Coordinator).
        self.ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._events)

    def dispatched(
        self, pool: str, address: str, req: SchedulingRequest, cached: float
    ) -> int:
        """Record a local dispatch; returns the id its completion must carry."""
        self._next_id += 1
        self._push((DISPATCH, self._next_id, pool, address, req.prompt_tokens,
                    req.max_tokens, req.adapter, cached, req.prefix_hashes))
        return self._next_id

    def completed(self, request_id: int) -> None:
        self._push((COMPLETE, request_id))

    def _push(self, event: Event) -> None:
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append(event)
        if not self.ready.is_set():
            self.ready.set()

    def take(self) -> list[Event]:
        """Everything buffered, oldest first, and the buffer emptied (flusher only)."""
        self.ready.clear()
        events = list(self._events)
        self._events.clear()
        return events
