"""Gateway replicas that route as one: shared routing state through Redis.

Each replica publishes what it routes (dispatches and completions, batched
every few milliseconds) and folds the other replicas' into the same
per-pool state it keeps for its own requests (picker.scheduling.state). The
request path only appends to a bounded local buffer; everything that talks
to Redis runs in background tasks, so a slow, partitioned or dead Redis
never delays or fails a request: the replica then routes on what it knows.
See docs/coordination.md for what is shared, how consistent it is and sizing.

Modules, one concept each:
- codec: the compact encoding of a batch of events and of a snapshot;
- outbox: the request path's bounded buffer of events to publish;
- bus: the Redis connection (streams, registry, snapshot key), every call bounded;
- replicas: identity, liveness, the other replicas' outstanding requests;
- fold: applying another replica's events to the schedulers;
- scrapes: shared scrape results (one owner per pod among the live replicas);
- snapshot: the late joiner's warm start (prefix index, adapter residency);
- coordinator: the lifecycle (connect, flush, read, sweep, reconnect with backoff).
"""

from picker.coordination.coordinator import CoordinationStats, Coordinator
from picker.coordination.outbox import Outbox

__all__ = ["CoordinationStats", "Coordinator", "Outbox"]
