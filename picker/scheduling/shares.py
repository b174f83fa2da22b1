"""Fair shares of a pool's batch slots between the tenants using it.

The fair queue (picker.scheduling.fair_queue) only orders what waits in the
gateway. Once a request is dispatched it waits first come, first served
inside the engine for one of the pod's batch slots (vLLM's `max_num_seqs`,
SGLang's `max_running_requests`). Bounding each pod's in-flight requests by
its slots (picker.scheduling.flow) keeps that engine queue near zero, but a
work-conserving gateway still fills every slot with whichever tenant has the
most waiting: a quiet tenant's request then waits for a slot to free, about
service time over slots, many times its own prefill. Measured through the
real path (tests/test_fairness.py): 0.045 s TTFT p95 alone, 4.6 s beside a
tenant sending 10x its share.

So, like the seats of Kubernetes' API Priority and Fairness, while more than
one tenant is active on a pool (a request in flight, or one arrived within
`saturation.fairShareWindow`), a tenant may hold at most its weighted share
of the pool's learned slots (at least one): its weight over the active
tenants' total. A tenant alone may use everything. Nothing is preempted:
work dispatched before another tenant arrived drains by itself, and what
is over its share waits in the admission queue, which releases the fair
queue's next waiter among tenants within their share. A tenant within its
share therefore finds a free slot on arrival.

The counts are this replica's own requests: replicas share pods' in-flight
totals (picker.coordination), not per-tenant counts. State is one entry per
tenant active within the window, dropped once it is idle past it.
"""

from __future__ import annotations

# Drop idle tenants' entries at most this often (seconds), and whenever this many pile up.
PRUNE_INTERVAL_S = 1.0
PRUNE_SIZE = 256
MIN_SHARE = 1.0


class TenantShares:
    """Per-tenant in-flight requests on one pool, and who was active recently."""

    __slots__ = ("_inflight", "_pruned_at", "_seen", "_weight")

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._weight: dict[str, float] = {}
        self._pruned_at = 0.0

    def __len__(self) -> int:
        """Tenants seen within the window, or with requests in flight (bounded)."""
        return len(self._seen)

    def inflight(self, tenant: str) -> int:
        """Requests of `tenant` this replica has in flight on the pool."""
        return self._inflight.get(tenant, 0)

    def seen(self, tenant: str, weight: float, now: float, window: float) -> None:
        """`tenant` (of fair-share `weight`) sent a request to the pool at `now`."""
        self._seen[tenant] = now
        self._weight[tenant] = weight
        if now - self._pruned_at >= PRUNE_INTERVAL_S or len(self._seen) > PRUNE_SIZE:
            self._prune(now, window)

    def dispatched(self, tenant: str) -> None:
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1

    def completed(self, tenant: str) -> None:
        left = self._inflight.get(tenant, 0) - 1
        if left > 0:
            self._inflight[tenant] = left
        else:
            self._inflight.pop(tenant, None)

    def share(self, tenant: str, slots: float, now: float, window: float) -> float | None:
        """`tenant`'s share of `slots` now, or None when it is not limited (one tenant
        active, shares off, slots unknown). Loops over the active tenants only."""
        if window <= 0 or slots <= 0:
            return None
        since = now - window
        inflight = self._inflight
        total = 0.0
        others = False
        for name, at in self._seen.items():
            if at >= since or name in inflight:
                total += self._weight.get(name, 1.0)
                others = others or name != tenant
        if not others:
            return None
        mine = self._weight.get(tenant, 1.0)
        if tenant not in self._seen:
            total += mine
        return max(MIN_SHARE, slots * mine / total)

    def capped(self, tenant: str, slots: float, now: float, window: float) -> bool:
        """`tenant` holds its whole share of `slots`: its next request must wait."""
        share = self.share(tenant, slots, now, window)
        return share is not None and self._inflight.get(tenant, 0) >= share

    def _prune(self, now: float, window: float) -> None:
        self._pruned_at = now
        since = now - max(window, 0.0)
        idle = [t for t, at in self._seen.items() if at < since and t not in self._inflight]
        for tenant in idle:
            del self._seen[tenant]
            self._weight.pop(tenant, None)
