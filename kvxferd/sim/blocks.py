"""Block bookkeeping of the simulated engine: one shared id space and a prefix cache.

Like vLLM's block pool, every KV-cache group draws from one id space and block 0 is the
reserved null block. The free list is LIFO (the last freed block is handed out first), so a
running engine's requests get scattered, non-contiguous ids, as real ones do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvxferd.errors import BlockIdError, PoolExhaustedError

NULL_BLOCK = 0


class BlockAllocator:
    """Free list over block ids 1..num_blocks-1; double frees and foreign ids are errors."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise BlockIdError("num_blocks", f"{num_blocks} leaves no block besides the null one")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out 1 first
        self._used: set[int] = set()

    @property
    def total(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def free_count(self) -> int:
        """Blocks on the free list now."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the top of the free list; PoolExhaustedError if fewer are free."""
        if n > len(self._free):
            raise PoolExhaustedError(
                f"KV pool exhausted: {n} blocks needed, {len(self._free)} of {self.total} free"
            )
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the free list (the last one given is the next handed out)."""
        for b in blocks:
            if b not in self._used:
                raise BlockIdError("block_ids", f"block {b} freed but not allocated")
            self._used.discard(b)
            self._free.append(b)


PrefixKey = tuple[int, int, int]
"""(prompt seed, group index, block ordinal) of a full attention block."""


@dataclass
class _Entry:
    block: int
    refs: int = 0


class PrefixCache:
    """Full attention blocks kept after their request, found again by :data:`PrefixKey`.

    Entries in use by a request are pinned (``refs > 0``); unpinned ones are evicted least
    recently used first when the pool runs low.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[PrefixKey, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, key: PrefixKey) -> int | None:
        """The cached block for ``key``, pinned until :meth:`release`; None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.refs += 1
        self._entries.move_to_end(key)
        return entry.block

    def release(self, key: PrefixKey) -> None:
        """Unpin a block taken with :meth:`acquire`."""
        entry = self._entries[key]
        if entry.refs <= 0:
            raise BlockIdError("prefix", f"block {entry.block} released more often than acquired")
        entry.refs -= 1

    def insert(self, key: PrefixKey, block: int) -> bool:
        """Keep ``block`` (unpinned) under ``key``; False if the key is already cached."""
        if key in self._entries:
            return False
        self._entries[key] = _Entry(block)
        return True

    def evict(self, n: int) -> list[int]:
        """Drop up to ``n`` unpinned entries, least recently used first; their blocks."""
        out: list[int] = []
        for key in list(self._entries):
            if len(out) >= n:
                break
            if self._entries[key].refs == 0:
                out.append(self._entries.pop(key).block)
        return out
