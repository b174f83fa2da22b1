"""Compact encoding of what a replica routed: one stream entry per batch of events.

An entry has three fields: `m`, the batch's metadata as JSON (orjson: sending
time, sequence number, a table of the (pool, pod address) pairs the batch
names, the dispatches and the completions), `h`, the dispatches' prefix block
hashes concatenated as little-endian uint64 (8 bytes per 64 prompt
characters: the bulk of a batch, so kept binary), and `bye` on a replica's
last entry. Pods are named by pool and address, never by row: rows differ
between replicas (each assigns them as its pods appear); the receiver
resolves the address with its own O(1) map.

Events as the request path buffers them (plain tuples, no allocation beyond):
- `(DISPATCH, request_id, pool, address, prompt_tokens, max_tokens, adapter,
  cached, prefix_hashes)`;
- `(COMPLETE, request_id)`.
Request ids are per replica (a counter); (replica, id) is unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

DISPATCH = 0
COMPLETE = 1
VERSION = 1
# Blocks shared per dispatch (≈ 32k prompt characters of prefix): a remote pod's
# match then covers any prefix up to there; the rest stays local knowledge.
MAX_SHARED_BLOCKS = 512
# A batch ends at whichever comes first; more events make more entries.
MAX_BATCH_EVENTS = 256
MAX_BATCH_HASH_BYTES = 64 * 1024

HASH_DTYPE = np.dtype("<u8")
_NO_HASHES = np.empty(0, dtype=HASH_DTYPE)

Event = tuple[Any, ...]


class CodecError(ValueError):
    """An entry that is not a batch this version can read (skipped, counted)."""


@dataclass(frozen=True, slots=True)
class RemoteDispatch:
    request_id: int
    pool: str
    address: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    cached: float
    prefix_hashes: np.ndarray


@dataclass(frozen=True, slots=True)
class Batch:
    """One decoded entry: what one replica routed during one flush interval."""

    sent_at: float  # the origin's wall clock (time.time()) when it flushed
    seq: int
    dispatches: list[RemoteDispatch] = field(default_factory=list)
    completions: list[int] = field(default_factory=list)
    bye: bool = False


def encode_batches(
    events: Sequence[Event], seq: int, sent_at: float, bye: bool = False
) -> list[dict[bytes, bytes]]:
    """Stream entries for `events` (in order), split at the batch bounds; at least
    one entry even when `events` is empty (that one is a heartbeat, or the bye)."""
    entries: list[dict[bytes, bytes]] = []
    start = 0
    while True:
        end, hash_bytes = start, 0
        while end < len(events) and end - start < MAX_BATCH_EVENTS:
            event = events[end]
            if event[0] == DISPATCH:
                size = min(len(event[8]), MAX_SHARED_BLOCKS) * 8
                if hash_bytes + size > MAX_BATCH_HASH_BYTES and end > start:
                    break
                hash_bytes += size
            end += 1
        last = end >= len(events)
        entries.append(_encode_one(events[start:end], seq + len(entries), sent_at, bye and last))
        if last:
            return entries
        start = end


def _encode_one(
    events: Sequence[Event], seq: int, sent_at: float, bye: bool
) -> dict[bytes, bytes]:
    pods: dict[tuple[str, str], int] = {}
    dispatches: list[list[Any]] = []
    completions: list[int] = []
    hashes: list[np.ndarray] = []
    for event in events:
        if event[0] == COMPLETE:
            completions.append(event[1])
            continue
        _, rid, pool, address, prompt, output, adapter, cached, blocks = event
        pod = pods.setdefault((pool, address), len(pods))
        blocks = blocks[:MAX_SHARED_BLOCKS]
        hashes.append(blocks)
        dispatches.append([rid, pod, prompt, output, adapter, round(cached, 3), len(blocks)])
    meta = {
        "v": VERSION,
        "t": sent_at,
        "s": seq,
        "p": [list(k) for k in pods],
        "d": dispatches,
        "c": completions,
    }
    entry = {b"m": orjson.dumps(meta)}
    if hashes:
        entry[b"h"] = np.concatenate(hashes).astype(HASH_DTYPE, copy=False).tobytes()
    if bye:
        entry[b"bye"] = b"1"
    return entry


def decode_batch(fields: dict[bytes, bytes]) -> Batch:
    """The batch of one stream entry; CodecError when it is not one."""
    try:
        meta = orjson.loads(fields[b"m"])
        if meta["v"] != VERSION:
            raise CodecError(f"batch version {meta['v']!r}, expected {VERSION}")
        raw = fields.get(b"h", b"")
        if len(raw) % 8:
            raise CodecError("prefix hashes not a whole number of uint64")
        all_hashes = np.frombuffer(raw, dtype=HASH_DTYPE) if raw else _NO_HASHES
        pods = [(str(p), str(a)) for p, a in meta["p"]]
        dispatches = []
        offset = 0
        for rid, pod, prompt, output, adapter, cached, nblocks in meta["d"]:
            pool, address = pods[pod]
            blocks = all_hashes[offset : offset + nblocks]
            offset += nblocks
            dispatches.append(
                RemoteDispatch(int(rid), pool, address, int(prompt), int(output),
                               adapter, float(cached), blocks)
            )
        if offset != len(all_hashes):
            raise CodecError("prefix hashes do not match the dispatches' block counts")
        completions = [int(c) for c in meta["c"]]
        return Batch(float(meta["t"]), int(meta["s"]), dispatches, completions,
                     fields.get(b"bye") == b"1")
    except CodecError:
        raise
    except (KeyError, ValueError, TypeError, IndexError) as exc:  # JSONDecodeError is a ValueError
        raise CodecError(f"not a batch: {type(exc).__name__}: {exc}") from None
