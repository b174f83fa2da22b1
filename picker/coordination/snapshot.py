"""A late joiner's warm start: the prefix index and adapter residency, plus positions.

Every replica stores one periodically (`snapshotInterval`, under
`<prefix>:snapshot`, expiring after three intervals): its merged view, which
covers every replica's traffic. A replica that starts reads it once, loads
each pod's prefix LRU (most recent first, so recency survives) and when each
adapter was last sent there, and starts reading every stream at the position
the snapshot names, so what happened after the snapshot is replayed from the
streams rather than lost. In-flight counts are not in it: they come from
that replay (dispatches whose completion is not yet in the stream).

Encoding like a batch's: `m` is JSON (positions, per pool the pods' addresses,
block counts and adapter ages in seconds), `h` the block hashes as uint64.
Size: 8 bytes per (pod, block) held, at most pods × blocksPerPod × 8 (about
250 KB per pod at the default 31,250 blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from picker.coordination.codec import HASH_DTYPE, CodecError

if TYPE_CHECKING:
    from picker.director import Director
    from picker.scheduling.scheduler import Scheduler

VERSION = 1


def build(director: Director, positions: dict[str, bytes], now: float, wall: float) -> dict[
    bytes, bytes
]:
    """The snapshot fields of the director's current state."""
    pools: list[dict[str, Any]] = []
    chunks: list[np.ndarray] = []
    for name, sched in director.schedulers.items():
        state, pool = sched.state, sched.pool
        pods = []
        for address, pod in pool.pods.items():
            blocks = state.prefix.blocks(pod.row)
            if blocks:
                chunks.append(np.array(blocks, dtype=HASH_DTYPE))
            sent = state.adapter_sent[pod.row] if pod.row < len(state.adapter_sent) else ()
            adapters = {
                adapter: round(now - float(sent[slot]), 3)
                for adapter, slot in pool.adapter_index.items()
                if slot < len(sent) and sent[slot] > 0
            }
            pods.append([address, len(blocks), adapters])
        pools.append({"name": name, "pods": pods})
    meta = {
        "v": VERSION,
        "t": wall,
        "positions": {r: p.decode() for r, p in positions.items()},
        "pools": pools,
    }
    raw = np.concatenate(chunks).tobytes() if chunks else b""
    return {b"m": orjson.dumps(meta), b"h": raw}


def apply(director: Director, fields: dict[bytes, bytes], now: float) -> dict[str, bytes]:
    """Load a snapshot into the director's schedulers; the stream positions it names.

    Pools and pods unknown here are skipped; an adapter time is kept only when
    newer than what this replica already knows.
    """
    try:
        meta = orjson.loads(fields[b"m"])
        if meta["v"] != VERSION:
            raise CodecError(f"snapshot version {meta['v']!r}, expected {VERSION}")
        hashes = np.frombuffer(fields.get(b"h", b""), dtype=HASH_DTYPE)
        offset = 0
        for entry in meta["pools"]:
            sched = director.schedulers.get(entry["name"])
            for address, count, adapters in entry["pods"]:
                blocks = hashes[offset : offset + count]
                offset += count
                pod = sched.pool.pods.get(address) if sched is not None else None
                if pod is None or sched is None:
                    continue
                _load_pod(sched, pod.row, blocks, adapters, now)
        return {str(r): str(p).encode() for r, p in meta["positions"].items()}
    except CodecError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise CodecError(f"not a snapshot: {type(exc).__name__}: {exc}") from None


def _load_pod(
    sched: Scheduler, row: int, blocks: np.ndarray, adapters: dict[str, float], now: float
) -> None:
    state = sched.state
    state.sync()
    if len(blocks):
        state.prefix.insert(row, blocks.tolist())
    for adapter, age in adapters.items():
        slot = sched.pool.adapter_index.get(adapter)
        sent_at = now - float(age)
        if slot is not None and sent_at > state.adapter_sent[row, slot]:
            state.adapter_sent[row, slot] = sent_at
