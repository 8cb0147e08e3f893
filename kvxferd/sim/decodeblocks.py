"""A decode request's local blocks: prefix-cache hits for its full attention blocks, fresh
blocks for the rest, and how they go back once its pull ended.

Fresh full attention blocks whose bytes were verified join the prefix cache; blocks of a pull
that could not be confirmed stopped are never reused (a sidecar may still write them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.sim.blocks import BlockAllocator, PrefixCache, PrefixKey
from kvxferd.wire import Manifest

log = logging.getLogger(__name__)


@dataclass
class DecodeBlocks:
    """A decode request's local blocks: cache hits (-1 in the pull) and fresh ones."""

    ids: list[list[int]]
    pull_ids: list[list[int]]
    hits: list[PrefixKey]
    fresh_full: list[tuple[PrefixKey, int]]
    fresh_other: list[int]


def take_blocks(
    manifest: Manifest,
    prefix: PrefixCache,
    allocate: Callable[[int], list[int]],
    seed: int,
    need: list[int],
    num_tokens: int,
) -> DecodeBlocks:
    """Local blocks for a decode: prefix-cache hits for full attention blocks, else fresh
    (``allocate``; the hits are unpinned again when it raises)."""
    lease = DecodeBlocks([], [], [], [], [])
    slots: list[tuple[int, int, PrefixKey | None]] = []  # (group, position, cache key)
    for g, n in enumerate(need):
        group = manifest.groups[g]
        full = num_tokens // group.block_size if group.kind == "full_attention" else 0
        lease.ids.append([-1] * n)
        lease.pull_ids.append([-1] * n)
        for o in range(n):
            key = (seed, g, o) if o < full else None
            hit = prefix.acquire(key) if key is not None else None
            if hit is not None:
                assert key is not None
                lease.hits.append(key)
                lease.ids[g][o] = hit
            else:
                slots.append((g, o, key))
    try:
        fresh = allocate(len(slots))
    except BaseException:
        for key in lease.hits:
            prefix.release(key)
        raise
    for (g, o, key), b in zip(slots, fresh, strict=True):
        lease.ids[g][o] = lease.pull_ids[g][o] = b
        if key is None:
            lease.fresh_other.append(b)
        else:
            lease.fresh_full.append((key, b))
    return lease


def return_blocks(
    lease: DecodeBlocks, prefix: PrefixCache, blocks: BlockAllocator, keep: bool, settled: bool
) -> None:
    """Unpin hits; cache fresh full blocks whose bytes are right (``keep``); free the rest.
    Blocks of an unsettled pull are never reused (a sidecar may still write them)."""
    for key in lease.hits:
        prefix.release(key)
    if not settled:
        n = len(lease.fresh_full) + len(lease.fresh_other)
        log.error("quarantining %d blocks of an unsettled pull", n)
        return
    free = list(lease.fresh_other)
    for key, b in lease.fresh_full:
        if not (keep and prefix.insert(key, b)):
            free.append(b)
    blocks.free(free)
