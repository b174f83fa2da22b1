"""The Redis server's clock as the replicas' common one, so host clock skew does not age entries.

An entry's age decides two things on the reader: whether its writer is alive
(picker.coordination.replicas) and whether a shared scrape result is fresh
enough to skip a scrape (picker.coordination.scrapes, a window of ~110 ms).
Measured between the writer's and the reader's wall clocks, a skew of 40 ms
between hosts made every result of one owner look late (counted fallbacks),
and one beyond `replicaTimeout` would make a live peer look dead.

A stream entry's id starts with the Redis server's time in milliseconds when it
was appended (XADD `*`). Each replica learns the offset of its own wall clock
to the server's from its own appends: the id of the entry it just wrote against
the midpoint of the round trip, kept from the fastest round trip (the smallest
error) of the last REFRESH_S. The age of another replica's entry is then
`wall + offset - id_time`: one clock for both ends, within half that round trip
plus 1 ms, whatever the hosts' skew. What it leaves out is the writer's own
half round trip from encoding to the append (sub-millisecond on a LAN).
Until this replica has appended once it falls back to the writer's wall clock.
"""

from __future__ import annotations

import math

# The best (fastest round trip) sample is replaced by any newer one after this:
# the hosts' clocks drift, and an old best would keep its drift.
REFRESH_S = 10.0


def entry_time_s(entry_id: bytes) -> float | None:
    """The server time (Unix seconds) an entry id names; None when it is not `ms-seq`."""
    ms, dash, _ = entry_id.partition(b"-")
    if not dash or not ms.isdigit():
        return None
    return int(ms) / 1000.0


class ServerClock:
    """This host's offset to the Redis server's clock, from its own appends."""

    def __init__(self) -> None:
        self.offset_s: float | None = None  # server time - local wall time
        self.rtt_s = math.inf  # round trip of the sample the offset came from
        self._sampled_at = -math.inf

    def observe(self, sent_wall: float, replied_wall: float, entry_id: bytes | None) -> None:
        """This replica appended `entry_id`: the call left at `sent_wall`, replied at
        `replied_wall` (local wall clock)."""
        if entry_id is None or replied_wall < sent_wall:
            return
        server = entry_time_s(entry_id)
        if server is None:
            return
        rtt = replied_wall - sent_wall
        if rtt <= self.rtt_s or replied_wall - self._sampled_at > REFRESH_S:
            self.offset_s = server - (sent_wall + replied_wall) / 2
            self.rtt_s = rtt
            self._sampled_at = replied_wall

    def age_s(self, entry_id: bytes, wall: float, writer_sent_at: float) -> float:
        """How long ago the entry was written, at local wall time `wall` (never negative);
        by the writer's wall clock (`writer_sent_at`) until an offset is known."""
        server = entry_time_s(entry_id) if self.offset_s is not None else None
        if server is None or self.offset_s is None:
            return max(0.0, wall - writer_sent_at)
        return max(0.0, wall + self.offset_s - server)
