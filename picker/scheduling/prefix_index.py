"""Which prompt prefixes the gateway last sent to which pod (one index per pool).

The gateway cannot see a pod's KV cache, but it knows what it routed: a pod
that just served a prompt most likely still holds that prompt's KV blocks.
Each block hash is chained on the previous one, so a hash stands for the
whole prefix up to its block and a match is a walk from the first block.

Structures:
- per pod, a bounded LRU (`OrderedDict`) of block hashes, evicting the least
  recently routed block when full;
- a reverse map hash -> bitmask of pool rows (a Python int: AND over 1,000 or
  10,000 bits is one C call), so a match costs one dict lookup and one AND
  per block, independent of the number of pods.

A request's blocks are inserted last-block-first, so the first blocks are the
most recent and the deepest blocks are evicted first: an evicted tail only
shortens a pod's match, an evicted head would hide the whole prefix.

Memory: about 200 bytes per (pod, block) entry in CPython (both maps, see
bench/results/scoring.md), so the default 31,250 blocks per pod (the
reference picker's default, ~2M characters ≈ 500k tokens of prefix per pod)
bounds the index at ~6 MB per pod; lower `blocks_per_pod` for pools of
hundreds of pods.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

DEFAULT_BLOCKS_PER_POD = 31_250


class PrefixIndex:
    """Bounded per-pod LRU of routed block hashes with a hash -> pods bitmask map."""

    __slots__ = ("_lru", "_owners", "blocks_per_pod")

    def __init__(self, blocks_per_pod: int = DEFAULT_BLOCKS_PER_POD) -> None:
        if blocks_per_pod < 1:
            raise ValueError("blocks_per_pod must be at least 1")
        self.blocks_per_pod = blocks_per_pod
        self._owners: dict[int, int] = {}
        self._lru: dict[int, OrderedDict[int, None]] = {}

    def __len__(self) -> int:
        """Total (pod, block) entries held."""
        return sum(len(lru) for lru in self._lru.values())

    def pod_blocks(self, row: int) -> int:
        lru = self._lru.get(row)
        return 0 if lru is None else len(lru)

    @property
    def distinct_blocks(self) -> int:
        return len(self._owners)

    def insert(self, row: int, hashes: list[int]) -> None:
        """Record that the prefix `hashes` was routed to `row` (most recent use)."""
        if not hashes:
            return
        lru = self._lru.get(row)
        if lru is None:
            lru = self._lru[row] = OrderedDict()
        owners = self._owners
        bit = 1 << row
        cap = self.blocks_per_pod
        # Deepest block first, so the head of the prefix ends up most recent.
        for h in reversed(hashes[:cap]):
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            owners[h] = owners.get(h, 0) | bit
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)

    def forget(self, row: int) -> None:
        """Drop everything known about `row` (its pod left; the row may be reused)."""
        lru = self._lru.pop(row, None)
        if lru is None:
            return
        bit = 1 << row
        for h in lru:
            self._drop(h, bit)

    def _drop(self, h: int, bit: int) -> None:
        rest = self._owners.get(h, 0) & ~bit
        if rest:
            self._owners[h] = rest
        else:
            self._owners.pop(h, None)

    def match(self, hashes: list[int], capacity: int) -> np.ndarray | None:
        """Leading blocks matched per row (float64, length `capacity`); None if no row matches.

        Walks the blocks in order keeping the set of rows that matched every
        block so far; a row leaves the set at its first miss. The set only
        shrinks, so the distinct sets seen are few; their bitmasks are
        unpacked with one numpy call at the end.
        """
        owners = self._owners
        if not hashes:
            return None
        alive = owners.get(hashes[0], 0)
        if not alive:
            return None
        exits: list[int] = []
        lengths: list[int] = []
        for depth, h in enumerate(hashes[1:], start=1):
            nxt = alive & owners.get(h, 0)
            if nxt != alive:
                exits.append(alive & ~nxt)
                lengths.append(depth)
                alive = nxt
                if not alive:
                    break
        if alive:
            exits.append(alive)
            lengths.append(len(hashes))
        return _rows_weighted(exits, lengths, capacity)


def _rows_weighted(masks: list[int], values: list[int], capacity: int) -> np.ndarray:
    """out[row] = values[i] for the (disjoint) bitmask masks[i] containing row."""
    nbytes = (max(m.bit_length() for m in masks) + 7) // 8
    buf = b"".join(m.to_bytes(nbytes, "little") for m in masks)
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
    bits = bits.reshape(len(masks), nbytes * 8)
    out = np.zeros(capacity)
    width = min(capacity, nbytes * 8)
    if len(masks) == 1:
        out[:width] = bits[0, :width] * float(values[0])
    else:
        out[:width] = np.asarray(values, dtype=np.float64) @ bits[:, :width]
    return out
