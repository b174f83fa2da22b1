"""What a tenant's requests really generated, learned after they end, and the token
reservations corrected with it.

The picker routes on the request body and never reads a response (ext_proc's
response phases would cost a gRPC message and a wait per streamed chunk). Envoy
reads it instead: a Lua filter (igw_envoy.usage) takes the output token count from
the response's `usage` object (every non-streamed answer; a stream with
`stream_options.include_usage`), or counts the stream's token events when it has
none, and Envoy's gRPC access log brings the count to the picker in batches, off
the request path (picker.access_log). This ledger joins the two by request id:
`opened` when the picker routes a tenant's request, `ended` when its ext_proc call
closes, `measured` when the access log entry arrives, whichever of the last two
comes first. A request whose count never comes (a non-200 answer, a client gone
mid-stream) is dropped `LINGER_S` after it ended: its reservation stands, as it
did before anything was measured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from picker.tenants.identity import Tenant

if TYPE_CHECKING:
    from picker.tenants.limits import Grant, Limiter

log = logging.getLogger("picker.tenants.usage")

# How long an ended request waits for its access log entry: Envoy flushes the log
# every 200 ms (igw_envoy.usage); this is many flushes, and a slow picker loop.
LINGER_S = 10.0
# Bounds: requests in flight, and ended ones waiting; past them the oldest is dropped
# (its reservation stands) and counted.
MAX_OPEN = 65_536
MAX_ENDED = 65_536
SWEEP_INTERVAL_S = 1.0


@dataclass(slots=True)
class _Entry:
    tenant: Tenant
    grant: Grant | None
    prompt_tokens: int
    ended_at: float = 0.0


class UsageLedger:
    """Routed tenant requests until their output tokens are known. One event loop, no
    locks; every operation O(1) (the sweep pops expired entries from the front)."""

    def __init__(self, limiter: Limiter | None, *, linger_s: float = LINGER_S,
                 max_open: int = MAX_OPEN, max_ended: int = MAX_ENDED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limiter = limiter
        self.linger_s = linger_s
        self.max_open = max_open
        self.max_ended = max_ended
        self.clock = clock
        # routed requests whose count never came (no entry within linger_s, or dropped
        # at a bound): their reservation stands
        self.unmeasured = 0
        self._open: dict[str, _Entry] = {}
        self._ended: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open) + len(self._ended)

    def opened(self, request_id: str, tenant: Tenant, grant: Grant | None,
               prompt_tokens: int) -> None:
        """The picker routed it. Without an id (Envoy always sets one) nothing can
        match it later, so nothing is kept."""
        if not request_id:
            return
        if len(self._open) >= self.max_open:
            self._open.pop(next(iter(self._open)))
            self.unmeasured += 1
        self._open[request_id] = _Entry(tenant, grant, prompt_tokens)

    def ended(self, request_id: str) -> None:
        """Its ext_proc call closed: the access log entry follows within a flush."""
        entry = self._open.pop(request_id, None)
        if entry is None:
            return  # already measured (the log came first), or never opened
        entry.ended_at = self.clock()
        if len(self._ended) >= self.max_ended:
            self._ended.popitem(last=False)
            self.unmeasured += 1
        self._ended[request_id] = entry

    def measured(self, request_id: str, output_tokens: int, exact: bool) -> bool:
        """Envoy's access log reported the response's output tokens: count them for the
        tenant and correct its token reservation. False for an id it does not hold
        (not a tenant request, already dropped, or another replica's)."""
        entry = self._ended.pop(request_id, None) or self._open.pop(request_id, None)
        if entry is None:
            return False
        output = max(0, int(output_tokens))
        usage = entry.tenant.usage
        usage.output_tokens += output
        if not exact:
            usage.output_tokens_estimated += output
        if entry.grant is not None and self.limiter is not None:
            self.limiter.correct(entry.grant, entry.prompt_tokens + output)
        log.debug("usage request=%s tenant=%s output_tokens=%d exact=%s",
                  request_id, entry.tenant.name, output, exact)
        return True

    def sweep(self) -> int:
        """Drop the ended requests whose entry did not come within `linger_s`."""
        horizon = self.clock() - self.linger_s
        ended = self._ended
        dropped = 0
        while ended:
            entry = next(iter(ended.values()))
            if entry.ended_at > horizon:
                break
            ended.popitem(last=False)
            dropped += 1
        self.unmeasured += dropped
        return dropped

    async def sweeper(self, stopping: asyncio.Event) -> None:
        """Sweep every `SWEEP_INTERVAL_S` until the picker stops."""
        while not stopping.is_set():
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()
