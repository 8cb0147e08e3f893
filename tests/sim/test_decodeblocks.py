"""A decode request's local blocks: full attention blocks come from the prefix cache when
cached (not pulled), the rest fresh; verified fresh full blocks join the cache afterwards, and
the blocks of an unsettled pull are never reused.

Pure bookkeeping: the manifest is a stand-in with the two fields the lease reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvxferd.errors import PoolExhaustedError
from kvxferd.sim.blocks import BlockAllocator, PrefixCache
from kvxferd.sim.decodeblocks import return_blocks, take_blocks

# One full attention group of 16-token blocks and one Mamba group (one block per request).
MANIFEST = SimpleNamespace(groups=[SimpleNamespace(kind="full_attention", block_size=16),
                                   SimpleNamespace(kind="mamba", block_size=16)])  # fmt: skip
NEED = [3, 1]  # 40 tokens: two full attention blocks and a partial one, one state block
TOKENS = 40


def _take(prefix: PrefixCache, blocks: BlockAllocator, seed: int = 7):
    return take_blocks(MANIFEST, prefix, blocks.allocate, seed, NEED, TOKENS)  # type: ignore[arg-type]


def test_verified_full_blocks_are_cached_and_a_later_request_pulls_only_the_rest():
    prefix, blocks = PrefixCache(), BlockAllocator(16)
    first = _take(prefix, blocks)
    assert first.hits == [] and first.ids == first.pull_ids
    assert [key for key, _ in first.fresh_full] == [(7, 0, 0), (7, 0, 1)]  # the partial is not
    return_blocks(first, prefix, blocks, keep=True, settled=True)
    assert len(prefix) == 2 and blocks.free_count == blocks.total - 2  # cached, the rest free
    again = _take(prefix, blocks)
    assert again.hits == [(7, 0, 0), (7, 0, 1)]
    assert again.pull_ids[0][:2] == [-1, -1] and again.ids[0][:2] == first.ids[0][:2]
    return_blocks(again, prefix, blocks, keep=True, settled=True)
    assert len(prefix) == 2 and blocks.free_count == blocks.total - 2


def test_blocks_whose_bytes_were_wrong_are_freed_not_cached():
    prefix, blocks = PrefixCache(), BlockAllocator(16)
    return_blocks(_take(prefix, blocks), prefix, blocks, keep=False, settled=True)
    assert len(prefix) == 0 and blocks.free_count == blocks.total


def test_the_fresh_blocks_of_an_unsettled_pull_are_never_reused():
    prefix, blocks = PrefixCache(), BlockAllocator(16)
    return_blocks(_take(prefix, blocks), prefix, blocks, keep=True, settled=True)
    lease = _take(prefix, blocks)  # two hits, two fresh
    return_blocks(lease, prefix, blocks, keep=True, settled=False)
    assert blocks.free_count == blocks.total - 2 - 2  # the fresh ones stay out
    assert prefix.evict(2) == lease.ids[0][:2]  # the hits were unpinned all the same


def test_a_pool_too_short_for_the_fresh_blocks_unpins_the_hits_it_took():
    prefix, blocks = PrefixCache(), BlockAllocator(6)
    return_blocks(_take(prefix, blocks), prefix, blocks, keep=True, settled=True)
    blocks.allocate(blocks.free_count - 1)  # one free: two fresh blocks needed
    with pytest.raises(PoolExhaustedError):
        _take(prefix, blocks)
    assert len(prefix.evict(2)) == 2  # unpinned: evictable
