"""Who the other replicas are, whether they are alive, and what they have in flight.

Identity: a name per process start (`POD_NAME` or the host name, plus a
random suffix), so a restarted replica is a new one and never inherits the
bookkeeping of its previous life.

Liveness is judged on this replica's own clock: a peer was last heard at the
local time an entry of its arrived, less that entry's age by the peer's clock
(so an old entry read on catch-up does not make a dead peer look alive; a
clock skew between hosts shifts this by the skew). A peer silent for
`replicaTimeout` is dead, and the sweep, every `heartbeatInterval`, releases
everything it had in flight: a killed replica's work stops counting within
replicaTimeout + heartbeatInterval of its last entry (a live replica sends one
at least every heartbeatInterval). A clean stop says so (its bye entry) and
is released at once. While this replica cannot reach Redis it hears nobody,
so after replicaTimeout it routes on its own requests only.

Each peer's requests are kept by request id until their completion arrives;
one whose completion never comes (dropped while Redis was down) is released
after its pool's routeTimeout plus replicaTimeout, and a peer never holds more
than MAX_OUTSTANDING_PER_REPLICA (the oldest is released first).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field

from picker.scheduling.request import SchedulingRequest
from picker.scheduling.scheduler import Scheduler
from picker.scheduling.state import PoolState

log = logging.getLogger("picker.coordination")

MAX_OUTSTANDING_PER_REPLICA = 100_000


def default_replica_id() -> str:
    """`<pod or host name>-<6 hex>`: unique per process start."""
    base = os.environ.get("POD_NAME") or socket.gethostname() or "igw"
    return f"{base[:48]}-{secrets.token_hex(3)}"


@dataclass(slots=True)
class Outstanding:
    """A peer's request counted here: enough to release exactly what was counted."""

    scheduler: Scheduler
    state: PoolState
    row: int
    address: str
    request: SchedulingRequest
    counted_at: float  # local monotonic time of the fold
    max_age_s: float

    def release(self, now: float, origin_duration_s: float | None = None) -> None:
        # A reload may have given the pool a new state (new rows): nothing to undo there.
        if self.scheduler.state is self.state:
            self.scheduler.on_remote_complete(
                self.row, self.request, now, now - self.counted_at, self.address,
                origin_duration_s,
            )


@dataclass(slots=True)
class Peer:
    name: str
    last_heard: float
    shares_scrapes: bool = True  # as its latest entry said
    outstanding: dict[int, Outstanding] = field(default_factory=dict)


class Replicas:
    """The peers heard from, and their requests counted in this replica's state."""

    def __init__(self, me: str, timeout_s: float) -> None:
        self.me = me
        self.timeout_s = timeout_s
        self.peers: dict[str, Peer] = {}
        self.released_dead = 0  # requests released because their replica died or left
        self.released_aged = 0  # requests released because their completion never came

    def heard(self, name: str, now: float, age_s: float) -> Peer:
        """An entry of `name` arrived at `now`, `age_s` old by the sender's clock."""
        heard_at = now - age_s
        peer = self.peers.get(name)
        if peer is None:
            peer = self.peers[name] = Peer(name, heard_at)
            log.debug("coordination peer joined replica=%s", name)
        elif heard_at > peer.last_heard:
            peer.last_heard = heard_at
        return peer

    def add(self, peer: Peer, request_id: int, item: Outstanding, now: float) -> None:
        outstanding = peer.outstanding
        previous = outstanding.pop(request_id, None)
        if previous is not None:  # the same event twice (cannot happen, costs nothing)
            previous.release(now)
        outstanding[request_id] = item
        if len(outstanding) > MAX_OUTSTANDING_PER_REPLICA:
            oldest = next(iter(outstanding))
            outstanding.pop(oldest).release(now)
            self.released_aged += 1

    def complete(self, peer: Peer, request_id: int, now: float,
                 origin_duration_s: float | None = None) -> None:
        item = peer.outstanding.pop(request_id, None)
        if item is not None:  # unknown: counted before we heard, or already released
            item.release(now, origin_duration_s)

    def leave(self, name: str, now: float) -> None:
        """`name` is gone (its bye, or silence): release all it had in flight."""
        peer = self.peers.pop(name, None)
        if peer is None:
            return
        for item in peer.outstanding.values():
            item.release(now)
        self.released_dead += len(peer.outstanding)
        log.debug("coordination peer gone replica=%s released=%d", name,
                  len(peer.outstanding))

    def sweep(self, now: float) -> list[str]:
        """Release dead peers and requests whose completion is overdue; the dead's names."""
        dead = [p.name for p in self.peers.values() if now - p.last_heard > self.timeout_s]
        for name in dead:
            log.info("coordination replica %s silent for over %.1fs: its in-flight work "
                     "released", name, self.timeout_s)
            self.leave(name, now)
        for peer in self.peers.values():
            outstanding = peer.outstanding
            while outstanding:
                rid, item = next(iter(outstanding.items()))
                if now - item.counted_at <= item.max_age_s:
                    # fold order is `counted_at` order: the rest are younger (one with a
                    # shorter pool routeTimeout waits behind it, bounded by the longest)
                    break
                del outstanding[rid]
                item.release(now)
                self.released_aged += 1
        return dead

    def live(self, now: float) -> list[str]:
        """Peers heard within the timeout (this replica not included)."""
        return sorted(p.name for p in self.peers.values() if now - p.last_heard <= self.timeout_s)

    def scrape_owners(self, now: float) -> list[str]:
        """Live peers that publish the scrapes of the pods they own (this one not included)."""
        return sorted(p.name for p in self.peers.values()
                      if p.shares_scrapes and now - p.last_heard <= self.timeout_s)

    def outstanding(self) -> int:
        return sum(len(p.outstanding) for p in self.peers.values())
