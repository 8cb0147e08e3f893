"""What a memory region looks like to the sidecar: one block of engine-owned memory it maps.

The engine allocates its pooled KV-cache tensors; the sidecar maps the same bytes (POSIX shared
memory for DRAM, CUDA IPC for VRAM) so NIXL can register them. Everything above this package
sees only :class:`RegionSource`.
"""

from __future__ import annotations

import re
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from kvxferd.errors import MemoryRegionError

MemKind = Literal["DRAM", "VRAM"]

MAX_NAME_LEN = 200
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@runtime_checkable
class RegionSource(Protocol):
    """A mapped block of memory: where it is in this process and what kind it is."""

    @property
    def name(self) -> str:
        """Stable name (the shared-memory segment name for DRAM)."""
        ...

    @property
    def size(self) -> int:
        """Bytes of the region."""
        ...

    @property
    def mem(self) -> MemKind:
        """NIXL memory type: ``DRAM`` or ``VRAM``."""
        ...

    @property
    def device_id(self) -> int:
        """GPU index for VRAM, 0 for DRAM."""
        ...

    @property
    def base_addr(self) -> int:
        """Virtual address of byte 0 of the region in THIS process."""
        ...

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        ...

    def host_view(self) -> np.ndarray:
        """Writable uint8 numpy view of the bytes (DRAM only; VRAM raises MemoryRegionError)."""
        ...

    def backed_bytes(self) -> int:
        """Bytes of the region its memory still backs (:attr:`size` unless the owner shrank
        it): touching a byte past them kills this process with SIGBUS."""
        ...

    def close(self) -> None:
        """Unmap (and, for the owner, free) the region. Idempotent."""
        ...


def check_region_name(name: str) -> str:
    """Return ``name`` if usable as a segment name, else raise MemoryRegionError naming why."""
    if not isinstance(name, str) or not name:
        raise MemoryRegionError(f"region name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise MemoryRegionError(
            f"region name {name[:32]!r}... is {len(name)} chars, more than {MAX_NAME_LEN}"
        )
    if name in (".", "..") or not _NAME_RE.fullmatch(name):
        raise MemoryRegionError(
            f"region name {name!r} may only contain letters, digits, '_', '.', '-' "
            "(no slashes) and must not be '.' or '..'"
        )
    return name


def check_region_size(size: int, what: str = "size") -> int:
    """Return ``size`` if it is a positive int, else raise MemoryRegionError."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise MemoryRegionError(f"region {what} must be a positive int, got {size!r}")
    return size


def first_shrunk(sources: list[RegionSource]) -> tuple[str, str] | None:
    """``(field, why)`` of the first source whose memory no longer backs all of it (its owner
    truncated the segment: touching the missing pages raises SIGBUS), None if all are whole.
    The field is ``regions[i].size_bytes`` of the registration that named the sources."""
    for i, source in enumerate(sources):
        backed = source.backed_bytes()
        if backed < source.size:
            return f"regions[{i}].size_bytes", (
                f"segment {source.name!r} was truncated to {backed} of its {source.size} "
                "registered bytes; this registration's memory is no longer touched: "
                "unregister and register again")  # fmt: skip
    return None
