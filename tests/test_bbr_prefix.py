"""bbr.prefix: chained block hashes; the exact algorithm is a contract (docs/bbr.md)."""

from __future__ import annotations

from hashlib import blake2b

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bbr.prefix import BLOCK_CHARS, DEFAULT_MAX_BLOCKS, model_seed, prefix_hashes


def reference(model: str, prompt: str, max_blocks: int) -> list[int]:
    """The documented algorithm, written as plainly as possible."""
    prev = blake2b(model.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    out = []
    for i in range(min(len(prompt) // 64, max_blocks)):
        block = prompt[64 * i : 64 * (i + 1)].encode("utf-8", "surrogatepass")
        prev = blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def test_known_vector() -> None:
    # Pinned values: if these change, the simulator and stored affinity break.
    hashes = prefix_hashes("llama", "a" * 128 + "tail", 16)
    assert hashes.dtype == np.dtype("<u8")
    assert hashes.tolist() == reference("llama", "a" * 128, 16)
    seed = blake2b(b"llama", digest_size=8).digest()
    first = blake2b(seed + b"a" * 64, digest_size=8).digest()
    assert int(hashes[0]) == int.from_bytes(first, "little")
    assert model_seed("llama") == seed


def test_only_full_blocks() -> None:
    assert prefix_hashes("m", "x" * 63, 10).size == 0
    assert prefix_hashes("m", "x" * 64, 10).size == 1
    assert prefix_hashes("m", "x" * 127, 10).size == 1
    assert prefix_hashes("m", "", 10).size == 0


def test_trailing_partial_block_does_not_change_hashes() -> None:
    base = "p" * 64 * 3
    assert np.array_equal(prefix_hashes("m", base, 10), prefix_hashes("m", base + "extra", 10))


def test_max_blocks_cap() -> None:
    prompt = "z" * 64 * 50
    assert prefix_hashes("m", prompt, 7).size == 7
    assert prefix_hashes("m", prompt, 0).size == 0
    assert prefix_hashes("m", prompt, -1).size == 0
    assert np.array_equal(prefix_hashes("m", prompt, 7), prefix_hashes("m", prompt, 50)[:7])
    assert prefix_hashes("m", "z" * 64 * (DEFAULT_MAX_BLOCKS + 5)).size == DEFAULT_MAX_BLOCKS


def test_same_prefix_same_leading_hashes_then_divergence() -> None:
    shared = "".join(chr(97 + i % 26) for i in range(64 * 4))
    a = prefix_hashes("m", shared + "A" * 64 * 3, 100)
    b = prefix_hashes("m", shared + "B" * 64 * 3, 100)
    assert np.array_equal(a[:4], b[:4])
    assert not np.any(a[4:] == b[4:])


def test_chaining_a_changed_block_changes_every_later_hash() -> None:
    blocks = [f"{i:064d}" for i in range(8)]
    changed = list(blocks)
    changed[2] = "X" * 64
    a = prefix_hashes("m", "".join(blocks), 100)
    b = prefix_hashes("m", "".join(changed), 100)
    assert np.array_equal(a[:2], b[:2])
    assert not np.any(a[2:] == b[2:])  # later blocks are equal text, but hashes differ


def test_same_block_text_at_different_positions_hashes_differently() -> None:
    hashes = prefix_hashes("m", "r" * 64 * 5, 10)
    assert len(set(hashes.tolist())) == 5


def test_model_seed_changes_every_hash() -> None:
    prompt = "shared system prompt " * 40
    a = prefix_hashes("llama", prompt, 100)
    b = prefix_hashes("sql-lora", prompt, 100)
    assert a.size == b.size > 0
    assert not np.any(a == b)


def test_non_ascii_blocks_are_code_points() -> None:
    prompt = "é" * 64 + "日本語" * 30 + "🙂" * 70
    assert prefix_hashes("m", prompt, 100).tolist() == reference("m", prompt, 100)
    assert prefix_hashes("m", prompt, 100).size == len(prompt) // 64


def test_lone_surrogates_do_not_raise() -> None:
    prompt = "\ud800" * 64 + "a" * 64
    assert prefix_hashes("m", prompt, 10).tolist() == reference("m", prompt, 10)


def test_result_is_read_only() -> None:
    hashes = prefix_hashes("m", "q" * 640, 10)
    with pytest.raises(ValueError):
        hashes[0] = 1


@given(
    model=st.text(max_size=20),
    prompt=st.text(max_size=64 * 12),
    max_blocks=st.integers(min_value=0, max_value=15),
)
def test_matches_reference(model: str, prompt: str, max_blocks: int) -> None:
    assert prefix_hashes(model, prompt, max_blocks).tolist() == reference(model, prompt, max_blocks)


@given(
    shared=st.text(min_size=0, max_size=64 * 6),
    a=st.text(max_size=64 * 3),
    b=st.text(max_size=64 * 3),
)
def test_common_prefix_property(shared: str, a: str, b: str) -> None:
    """Hashes agree exactly on the blocks lying wholly inside the common prefix."""
    x, y = shared + a, shared + b
    common = 0
    while common < min(len(x), len(y)) and x[common] == y[common]:
        common += 1
    hx, hy = prefix_hashes("m", x, 100), prefix_hashes("m", y, 100)
    same_blocks = common // BLOCK_CHARS
    assert np.array_equal(hx[:same_blocks], hy[:same_blocks])
    n = min(hx.size, hy.size)
    assert not np.any(hx[same_blocks:n] == hy[same_blocks:n])
