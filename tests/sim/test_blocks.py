"""One shared block-id space with a LIFO free list, and the decode prefix cache."""

from __future__ import annotations

import pytest

from kvxferd.errors import BlockIdError, PoolExhaustedError
from kvxferd.sim.blocks import BlockAllocator, PrefixCache


def test_block_zero_is_never_handed_out():
    pool = BlockAllocator(5)
    assert pool.total == 4
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.free_count == 0


def test_free_list_is_lifo_so_ids_fragment():
    pool = BlockAllocator(9)
    a = pool.allocate(3)
    b = pool.allocate(3)
    assert a == [1, 2, 3] and b == [4, 5, 6]
    pool.free(a)
    # The last freed block comes back first: ids now arrive in reverse, interleaved with fresh.
    assert pool.allocate(4) == [3, 2, 1, 7]


def test_exhaustion_names_the_numbers_and_takes_nothing():
    pool = BlockAllocator(4)
    pool.allocate(2)
    with pytest.raises(PoolExhaustedError, match="2 blocks needed, 1 of 3 free"):
        pool.allocate(2)
    assert pool.free_count == 1


def test_double_free_and_foreign_ids_are_refused():
    pool = BlockAllocator(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(BlockIdError, match="not allocated"):
        pool.free([b])
    with pytest.raises(BlockIdError):
        pool.free([0])
    with pytest.raises(BlockIdError, match="num_blocks"):
        BlockAllocator(1)


def test_prefix_cache_pins_hits_and_evicts_unpinned_lru_first():
    cache = PrefixCache()
    assert cache.insert((1, 0, 0), 10)
    assert cache.insert((1, 0, 1), 11)
    assert cache.insert((2, 0, 0), 12)
    assert not cache.insert((1, 0, 0), 99)  # already cached: the caller keeps its block
    assert cache.acquire((9, 0, 0)) is None
    assert cache.acquire((1, 0, 0)) == 10  # pinned and now most recently used
    assert cache.evict(5) == [11, 12]  # the pinned entry survives
    assert len(cache) == 1
    cache.release((1, 0, 0))
    assert cache.evict(1) == [10]
    assert len(cache) == 0


def test_prefix_cache_refuses_unbalanced_release():
    cache = PrefixCache()
    cache.insert((1, 0, 0), 3)
    with pytest.raises(BlockIdError, match="released more often"):
        cache.release((1, 0, 0))
