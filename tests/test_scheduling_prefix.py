"""PrefixIndex (bounded per-pod LRU, reverse map, exact galloping match), footprint, demand."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.scheduling.prefix_demand import PrefixDemand
from picker.scheduling.prefix_footprint import PrefixFootprint
from picker.scheduling.prefix_index import PrefixIndex


def matched(index: PrefixIndex, hashes: list[int], capacity: int = 8) -> list[float]:
    out = index.match(hashes, capacity)
    return [0.0] * capacity if out is None else out.tolist()


def test_match_stops_at_each_pods_first_miss():
    index = PrefixIndex(100)
    index.insert(0, [1, 2, 3, 4])
    index.insert(1, [1, 2])
    index.insert(2, [1, 2, 3, 4, 5, 6])
    index.insert(3, [9])
    assert matched(index, [1, 2, 3, 4, 5]) == [4, 2, 5, 0, 0, 0, 0, 0]
    assert index.match([7, 1, 2], 8) is None  # first block unknown: nobody matches
    assert index.match([], 8) is None


def test_insert_says_how_many_leading_blocks_some_pod_already_held():
    index = PrefixIndex(100)
    assert index.insert(0, [1, 2, 3, 4]) == 0
    assert index.insert(1, [1, 2, 5]) == 2  # held by pod 0
    assert index.insert(1, [1, 2, 5, 6]) == 3  # its own 5 counts too
    assert index.insert(2, []) == 0


def test_footprint_sums_the_latest_shared_depth_of_each_root_seen_within_the_window():
    fp = PrefixFootprint(window_s=60.0, max_roots=3)
    fp.record(1, 0, 0.0)  # nothing shared: not a shared prefix
    assert (fp.tokens, len(fp)) == (0, 0)
    fp.record(1, 2_000, 1.0)
    fp.record(2, 500, 2.0)
    fp.record(2, 800, 3.0)  # a conversation grows: its latest depth
    assert fp.tokens == 2_800
    fp.record(3, 100, 4.0)
    fp.record(4, 100, 5.0)  # beyond 3 roots: the least recently seen (1) goes
    assert (fp.tokens, len(fp)) == (1_000, 3)
    fp.expire(64.5)  # root 2 last seen at 3.0, root 3 at 4.0: out of the window
    assert (fp.tokens, len(fp)) == (100, 1)
    fp.expire(1_000.0)
    assert (fp.tokens, len(fp)) == (0, 0)


def test_demand_is_each_roots_share_of_the_pools_recent_requests():
    demand = PrefixDemand(horizon_s=10.0)
    for _ in range(3):
        demand.record(1, 0.0)
    demand.record(2, 0.0)
    demand.record(None, 0.0)  # a request without prefix blocks counts in the pool's total
    assert demand.share(1, 0.0) == pytest.approx(0.6)
    assert demand.share(2, 0.0) == pytest.approx(0.2)
    assert demand.share(3, 0.0) == 0.0
    # 10 s on, the old counts weigh e^-1 of a new one: root 2's new request leads
    demand.record(2, 10.0)
    old = np.exp(-1.0)
    assert demand.share(2, 10.0) == pytest.approx((1 + old) / (1 + 5 * old))
    assert demand.share(1, 10.0) == pytest.approx(3 * old / (1 + 5 * old))
    # with no requests the shares keep their proportions as everything decays alike
    assert demand.share(1, 40.0) == pytest.approx(demand.share(1, 10.0))


def test_demand_keeps_at_most_max_roots_dropping_the_least_recently_seen():
    demand = PrefixDemand(max_roots=3)
    for root in range(5):
        demand.record(root, float(root))
    demand.record(2, 5.0)  # seen again: now the most recent
    demand.record(9, 6.0)
    assert len(demand) == 3
    assert demand.share(0, 6.0) == demand.share(1, 6.0) == demand.share(3, 6.0) == 0.0
    assert min(demand.share(2, 6.0), demand.share(4, 6.0), demand.share(9, 6.0)) > 0.0


def test_lru_is_bounded_and_evicts_least_recent_deepest_first():
    index = PrefixIndex(blocks_per_pod=4)
    index.insert(0, [1, 2, 3])
    index.insert(0, [10, 11])  # 5 blocks > 4: evicts the oldest, block 3 (deepest of [1,2,3])
    assert index.pod_blocks(0) == 4
    assert matched(index, [1, 2, 3])[0] == 2
    assert matched(index, [10, 11])[0] == 2
    index.insert(0, [1, 2])  # touch: now 10, 11 are the oldest
    index.insert(0, [20])
    assert matched(index, [10, 11])[0] == 1
    assert matched(index, [1, 2])[0] == 2
    assert index.distinct_blocks == 4


def test_long_prompt_inserts_at_most_capacity_blocks():
    index = PrefixIndex(blocks_per_pod=8)
    index.insert(0, list(range(1, 101)))
    assert index.pod_blocks(0) == 8
    assert matched(index, list(range(1, 101)), 1) == [8]


def test_memory_bounded_under_churn_and_forget_cleans_reverse_map():
    index = PrefixIndex(blocks_per_pod=64)
    rng = np.random.default_rng(0)
    for i in range(2_000):
        index.insert(i % 16, rng.integers(1, 2**63, 20).tolist())
    assert len(index) == 16 * 64
    assert index.distinct_blocks <= 16 * 64
    for row in range(16):
        index.forget(row)
    assert len(index) == 0 and index.distinct_blocks == 0


def test_many_pods_dense_and_sparse_exits():
    index = PrefixIndex(1_000)
    head = list(range(1, 33))
    for row in range(0, 900, 3):  # 300 pods share a system prompt
        index.insert(row, head)
    index.insert(901, [*head, 50, 51, 52])
    index.insert(902, [*head, 50])
    out = index.match([*head, 50, 51, 52, 53], 1_024)
    assert out[0] == 32 and out[3] == 32 and out[1] == 0
    assert out[901] == 35 and out[902] == 33
    assert out.sum() == 300 * 32 + 35 + 33


def _naive(lrus: dict[int, OrderedDict], hashes: list[int], capacity: int) -> list[float]:
    out = [0.0] * capacity
    for row, lru in lrus.items():
        k = 0
        while k < len(hashes) and hashes[k] in lru:
            k += 1
        out[row] = float(k)
    return out


# A small universe of chains: two heads, each with a few branches, so prefixes
# overlap, LRUs overflow and evict, and re-touches reorder recency.
_CHAINS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9], [11, 12, 13, 14], [11, 15, 16, 17]]


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, len(_CHAINS) - 1), st.integers(1, 6)),
        min_size=1, max_size=40,
    ),
    query=st.tuples(st.integers(0, len(_CHAINS) - 1), st.integers(1, 6)),
    cap=st.integers(1, 7),
)
def test_galloping_match_equals_a_block_by_block_walk(ops, query, cap):
    """The O(changes·log) match must equal walking every block for every pod."""
    index = PrefixIndex(cap)
    for row, chain, length in ops:
        index.insert(row, _CHAINS[chain][:length])
    lrus = {row: OrderedDict.fromkeys(lru) for row, lru in index._lru.items()}
    hashes = _CHAINS[query[0]][: query[1]]
    assert matched(index, hashes) == _naive(lrus, hashes, 8)
