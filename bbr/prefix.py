"""Prefix-affinity block hashes (DESIGN §5): one chained hash per 64-character block.

Block i's hash covers the whole prompt up to the end of block i, because it is
chained on block i-1's; so two prompts share their first k hashes exactly when
they share their first k blocks (up to hash collisions), and a lookup can walk
the hashes in order and stop at the first miss.

The algorithm is a contract with the simulator (docs/bbr.md, "Prefix hashing"):

    H(x)   = BLAKE2b(x, digest_size=8)            (8-byte digest, no key)
    seed   = H(utf8(model))
    h[0]   = H(seed || utf8(block[0]))
    h[i]   = H(h[i-1] || utf8(block[i]))
    block[i] = prompt[64*i : 64*(i+1)]            (Python str slicing: code points)
    value  = int.from_bytes(h[i], "little")       (numpy dtype '<u8')

Only full blocks are hashed (an engine cannot reuse a partial block either), at
most `max_blocks` of them. BLAKE2b is in the stdlib and its C implementation
costs ~0.35-0.45 µs per block here; xxhash is not a dependency.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from hashlib import blake2b

import numpy as np

__all__ = [
    "BLOCK_CHARS",
    "DEFAULT_MAX_BLOCKS",
    "HASH_DTYPE",
    "model_seed",
    "prefix_hashes",
]

BLOCK_CHARS = 64  # 16 tokens × 4 characters
DEFAULT_MAX_BLOCKS = 4096  # 256 KiB of prompt text = bbr.prompt.PROMPT_CHAR_CAP
HASH_DTYPE = np.dtype("<u8")
DIGEST_SIZE = 8

# Copying a primed hash object is ~25% cheaper than calling the constructor with
# keyword arguments, and gives the same digest.
_EMPTY = blake2b(digest_size=DIGEST_SIZE)
_NO_HASHES = np.zeros(0, dtype=HASH_DTYPE)
_NO_HASHES.flags.writeable = False


@lru_cache(maxsize=1024)
def model_seed(model: str) -> bytes:
    """H(utf8(model)): the chain's starting value, so equal text under different
    models never shares hashes (different weights, different KV cache)."""
    return blake2b(model.encode("utf-8", "surrogatepass"), digest_size=DIGEST_SIZE).digest()


def _block_bounds(data: bytes, ascii_only: bool, blocks: int) -> Sequence[int]:
    """Byte offsets in `data` of the first `blocks` block starts, plus the end of the last."""
    if ascii_only:
        return range(0, (blocks + 1) * BLOCK_CHARS, BLOCK_CHARS)
    # A code point starts at every byte that is not a UTF-8 continuation byte.
    a = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero((a & 0xC0) != 0x80)
    bounds: list[int] = starts[: blocks * BLOCK_CHARS + 1 : BLOCK_CHARS].tolist()
    if len(bounds) == blocks:  # no partial block after the last full one
        bounds.append(len(data))
    return bounds


def prefix_hashes(model: str, prompt: str, max_blocks: int = DEFAULT_MAX_BLOCKS) -> np.ndarray:
    """Chained hashes of the prompt's full 64-character blocks, as a read-only uint64 array.

    O(len(prompt)) with one hash call per block; at most `max_blocks` blocks.
    """
    blocks = min(len(prompt) // BLOCK_CHARS, max_blocks)
    if blocks <= 0:
        return _NO_HASHES
    # Encode only what is hashed; a tail shorter than a block is not worth a copy.
    short = len(prompt) < (blocks + 1) * BLOCK_CHARS
    text = prompt if short else prompt[: blocks * BLOCK_CHARS]
    data = text.encode("utf-8", "surrogatepass")
    bounds = _block_bounds(data, len(data) == len(text), blocks)
    copy = _EMPTY.copy
    prev = model_seed(model)
    out: list[bytes] = []
    append = out.append
    start = bounds[0]
    for end in bounds[1:]:
        h = copy()
        h.update(prev + data[start:end])  # one 72-byte update beats two small ones
        prev = h.digest()
        append(prev)
        start = end
    return np.frombuffer(b"".join(out), dtype=HASH_DTYPE)
