"""Paged KV cache with prefix caching, in block counts (no token data is stored).

Mirrors vLLM's block manager closely enough for routing purposes: a block is 16 tokens; a
full prompt block is registered under its chained hash so later requests with the same prefix
reuse it; a freed block keeps its hash and stays reusable until it is evicted (least recently
freed first) to make room. Usage counts referenced blocks only, like vLLM's
``kv_cache_usage_perc``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Allocation:
    """The blocks one sequence holds: hashed prompt blocks plus anonymous ones."""

    hashed: list[int] = field(default_factory=list)
    anonymous: int = 0

    @property
    def blocks(self) -> int:
        return len(self.hashed) + self.anonymous


class KVCache:
    """Block accounting for one pod."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._plain_free = num_blocks  # free blocks holding no cached prefix
        self._refs: dict[int, int] = {}  # hash -> reference count, for every cached block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, LRU first

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take (free ones plus evictable cached ones)."""
        return self._plain_free + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    def match(self, hashes: list[int], limit: int) -> int:
        """Number of leading blocks (at most limit) already cached: stops at the first miss."""
        n = 0
        refs = self._refs
        for h in hashes[:limit]:
            if h not in refs:
                break
            n += 1
        return n

    def allocate(self, hashes: list[int], hits: int, total_blocks: int) -> Allocation | None:
        """Take total_blocks for a sequence reusing the first hits cached ones, or None.

        The remaining full prompt blocks are registered under their hashes at once (vLLM
        caches blocks when they are scheduled), so a request admitted right after can hit them.
        """
        new = total_blocks - hits
        # Hit blocks that sit in the evictable list are not free for this allocation.
        hit_evictable = sum(1 for h in hashes[:hits] if self._refs[h] == 0)
        if new > self.free_blocks - hit_evictable:
            return None
        alloc = Allocation()
        for h in hashes[:hits]:
            self._ref(h)
            alloc.hashed.append(h)
        self._take(new)
        for h in hashes[hits:total_blocks]:
            if h not in self._refs:  # a duplicate of a block cached elsewhere stays anonymous
                self._refs[h] = 1
                alloc.hashed.append(h)
        alloc.anonymous = new - (len(alloc.hashed) - hits)
        return alloc

    def grow(self, alloc: Allocation) -> bool:
        """One more anonymous block for a decoding sequence; False when the cache is full."""
        if self.free_blocks == 0:
            return False
        self._take(1)
        alloc.anonymous += 1
        return True

    def free(self, alloc: Allocation) -> None:
        """Release a sequence's blocks; its cached prefix stays reusable, tail evicted first."""
        for h in reversed(alloc.hashed):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None
        self._plain_free += alloc.anonymous
        alloc.hashed = []
        alloc.anonymous = 0

    def _ref(self, h: int) -> None:
        refs = self._refs[h]
        if refs == 0:
            del self._evictable[h]
        self._refs[h] = refs + 1

    def _take(self, n: int) -> None:
        """Consume n free blocks, evicting least recently freed cached blocks when needed."""
        from_plain = min(n, self._plain_free)
        self._plain_free -= from_plain
        for _ in range(n - from_plain):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
