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

    def blocks(self, row: int) -> list[int]:
        """`row`'s block hashes, most recently routed first: `insert` of this list
        rebuilds the same LRU (picker.coordination.snapshot)."""
        lru = self._lru.get(row)
        return [] if lru is None else list(reversed(lru))

    @property
    def distinct_blocks(self) -> int:
        return len(self._owners)

    def insert(self, row: int, hashes: list[int]) -> int:
        """Record that the prefix `hashes` was routed to `row` (most recent use); returns
        how many of its blocks some pod already held (the depth shared with earlier
        prompts: a held block's ancestors are held too, see below).

        Deepest block first, so a block is never more recent than its
        ancestors in the chain: eviction then always takes the deepest block,
        and every pod holds a *prefix* of every chain it saw; `match` relies on it.
        """
        if not hashes:
            return 0
        lru = self._lru.get(row)
        if lru is None:
            lru = self._lru[row] = OrderedDict()
        owners = self._owners
        bit = 1 << row
        cap = self.blocks_per_pod
        shared = 0
        for h in reversed(hashes[:cap]):
            if h in lru:
                lru.move_to_end(h)
                shared += 1
                continue
            lru[h] = None
            held = owners.get(h, 0)
            shared += held != 0
            owners[h] = held | bit
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            self._drop(old, bit)
        return shared

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

        Semantics: walk the blocks in order; each row stops at its first miss.
        Because a pod's LRU always keeps a prefix of every chain (see
        `insert`), the rows holding block d are exactly the rows still alive
        at depth d, and the alive set only shrinks; so instead of visiting
        every block the walk gallops to each depth where the set changes:
        O(changes × log blocks) lookups instead of O(blocks).
        """
        if not hashes:
            return None
        owners = self._owners
        alive = owners.get(hashes[0], 0)
        if not alive:
            return None
        n = len(hashes)
        exits: list[tuple[int, int]] = []
        depth = 0  # `alive` holds block `depth` (and, per the invariant, all before it)
        while alive:
            last = _last_depth_holding(owners, hashes, alive, depth, n)
            if last == n - 1:
                exits.append((alive, n))
                break
            nxt = owners.get(hashes[last + 1], 0) & alive
            exits.append((alive & ~nxt, last + 1))
            alive, depth = nxt, last + 1
        return _rows_valued(exits, capacity)


def _last_depth_holding(
    owners: dict[int, int], hashes: list[int], alive: int, depth: int, n: int
) -> int:
    """Deepest block index ≥ depth that every row of `alive` holds (galloping search)."""
    lo, step = depth, 1
    hi = n  # first index known (or assumed, at n) not to be fully held
    while lo + step < n:
        probe = lo + step
        if (owners.get(hashes[probe], 0) & alive) == alive:
            lo = probe
            step *= 2
        else:
            hi = probe
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (owners.get(hashes[mid], 0) & alive) == alive:
            lo = mid
        else:
            hi = mid
    return lo


# Exit sets with at most this many rows are converted bit by bit (cheap for the
# usual one or two pods holding a long conversation); larger ones with numpy.
_SPARSE_BITS = 8


def _rows_valued(exits: list[tuple[int, int]], capacity: int) -> np.ndarray:
    """out[row] = value for each (disjoint) (bitmask, value) in `exits`, 0 elsewhere."""
    out = np.zeros(capacity)
    rows: list[int] = []
    values: list[int] = []
    for mask, value in exits:
        if mask.bit_count() <= _SPARSE_BITS:
            while mask:
                low = mask & -mask
                rows.append(low.bit_length() - 1)
                values.append(value)
                mask ^= low
        else:
            nbytes = (mask.bit_length() + 7) // 8
            bits = np.unpackbits(
                np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8),
                count=min(capacity, nbytes * 8),
                bitorder="little",
            )
            out[np.flatnonzero(bits)] = value
    if rows:
        out[rows] = values
    return out
