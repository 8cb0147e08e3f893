"""Reusable host buffers for entries: the DRAM tier's memory and the file tier's staging.

A fresh allocation costs a page fault per 4 KiB on first touch (0.3 GB/s for 512 KiB buffers on
the 2-vCPU VMs here, against 8 GB/s for writing memory already mapped), which would dominate a
save. Buffers come back to the pool when their last reference goes (an evicted DRAM entry, a
staging buffer after its write or scatter) and are handed out again by size class, so a running
sidecar stops faulting once the pool is warm. Free buffers are bounded by ``free_limit`` bytes.

References make eviction safe: a load scattering from a DRAM entry, or an I/O thread writing a
just-saved entry to its file, holds a reference, and the bytes are reused only after both the
tier and every reader let go.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

_MIN_CLASS = 64 << 10


def size_class(n: int) -> int:
    """``n`` rounded up to 4 steps per power of two (at most 25% over), at least 64 KiB."""
    if n <= _MIN_CLASS:
        return _MIN_CLASS
    top = 1 << (n - 1).bit_length()  # next power of two >= n
    step = top // 8  # classes top/2 + k * top/8, k = 1..4
    return -(-n // step) * step


class Buffer:
    """A pooled uint8 array with a reference count; back to its pool when the count is zero."""

    def __init__(self, pool: BufferPool, array: np.ndarray) -> None:
        self.array = array
        self._pool = pool
        self._refs = 1

    def acquire(self) -> Buffer:
        """One more reference (returns self)."""
        with self._pool.lock:
            if self._refs <= 0:
                raise RuntimeError("acquire of a released buffer")
            self._refs += 1
        return self

    def release(self) -> None:
        """Drop a reference; the last one returns the array to the pool."""
        with self._pool.lock:
            self._refs -= 1
            if self._refs < 0:
                raise RuntimeError("buffer released more often than acquired")
            if self._refs == 0:
                self._pool._give(self.array)


class BufferPool:
    """Size-classed free lists of uint8 arrays; thread-safe."""

    def __init__(self, free_limit: int) -> None:
        self.free_limit = free_limit
        self.lock = threading.Lock()
        self.free_bytes = 0
        self.allocated = 0
        """Arrays created (not taken from a free list): a warm pool stops counting up."""
        self._free: defaultdict[int, list[np.ndarray]] = defaultdict(list)

    def take(self, n: int) -> Buffer:
        """A buffer of at least ``n`` bytes (one reference, the caller's)."""
        cls = size_class(n)
        with self.lock:
            free = self._free.get(cls)
            if free:
                self.free_bytes -= cls
                return Buffer(self, free.pop())
            self.allocated += 1
        return Buffer(self, np.empty(cls, dtype=np.uint8))

    def _give(self, array: np.ndarray) -> None:
        """Keep a released array for reuse, within the bound (called under ``lock``)."""
        if self.free_bytes + array.size <= self.free_limit:
            self._free[array.size].append(array)
            self.free_bytes += array.size
