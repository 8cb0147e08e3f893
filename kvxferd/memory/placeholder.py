"""Read-only zero pages left where a shared-memory source was mapped, once it is let go of.

Why: over UCX's TCP transport a READ of this process's memory is served by its own UCX worker,
which copies the bytes into GET replies as the socket to the reader drains (``memcpy`` in
``uct_tcp_ep_am_bcopy``, from the pending queue, whenever the worker is progressed). A reader
that stalls mid-READ (stopped, swapped out) leaves replies queued for as long as it stalls:
past its claim, past the unregister that waited for that claim and unmapped the memory. When it
resumed, this process copied from unmapped pages and died of SIGSEGV (or, had a new
registration been mapped there meanwhile, sent that engine's bytes). Neither NIXL's
deregistration nor UCX stops such queued replies, and no call tells whether any are left.

So a source let go of is not left as a hole: :func:`close_leaving_zeros` unmaps it and maps
private read-only zero pages over the same addresses (no memory behind them: every page is the
kernel's shared zero page, and nothing is charged to overcommit), so a late reply copies zeros,
never the engine's bytes (the engine's segment is released at once) and never another mapping.
The reader's pull has failed by then (its claim ended before its READ did), so the zeros are
never used. :meth:`Placeholder.vacate` unmaps them, once no UCX worker is left to read them.

Between the unmap and the new mapping (two system calls on one thread) the addresses are free:
a UCX progress thread running then could still fault, and another thread's mapping placed there
is never replaced (the zero pages are not mapped and :func:`close_leaving_zeros` says so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from dataclasses import dataclass

from kvxferd.memory.region import RegionSource
from kvxferd.memory.shm import SharedMemoryRegion

log = logging.getLogger(__name__)

MAP_FIXED_NOREPLACE = 0x100000
"""Linux (4.17+): map exactly at the address, failing (EEXIST) where anything is mapped."""
MAP_NORESERVE = 0x4000
"""Linux: reserve no swap (and read-only private pages are not charged to overcommit anyway)."""
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass(frozen=True)
class Placeholder:
    """Zero pages mapped at ``[address, address + length)``, where a source was."""

    address: int
    length: int

    def vacate(self) -> None:
        """Unmap the zero pages (only once no UCX worker may still serve a READ of them)."""
        if _libc.munmap(self.address, self.length) != 0:  # only for arguments never passed
            log.error("munmap of %#x+%d failed: errno %d", self.address, self.length,
                      ctypes.get_errno())  # fmt: skip


def occupy(address: int, length: int) -> Placeholder | None:
    """Map read-only zero pages at exactly ``[address, address + length)`` (page-aligned
    ``address``; ``length`` rounded up to pages) if nothing is mapped there; None otherwise."""
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE
    got = _libc.mmap(address, length, mmap.PROT_READ, flags, -1, 0)
    if got == address:
        return Placeholder(address, length)
    if got not in (None, _FAILED):  # a kernel before 4.17 took the address as a hint only
        _libc.munmap(got, length)
    return None


def close_leaving_zeros(region: RegionSource) -> Placeholder | None:
    """Close ``region``; where it was a mapped shared-memory segment that the close unmapped,
    map zero pages in its place and return them (see the module docstring). None for other
    sources, and where the mapping stays (views of it still held) or the place was taken."""
    if not isinstance(region, SharedMemoryRegion) or region.closed:
        region.close()
        return None
    address, length = region.base_addr, region.size
    region.close()
    placeholder = occupy(address, length)  # at once: no await, no other work in between
    if placeholder is None:
        log.debug("no zero pages at %#x for %s (still mapped, or taken)", address, region.name)
    return placeholder


__all__ = ["Placeholder", "close_leaving_zeros", "occupy"]
