"""DRAM regions in POSIX shared memory: the engine creates (and owns) a segment, the sidecar
attaches to it by name.

Segments are plain files under ``/dev/shm`` opened with ``os.open`` + ``mmap``, deliberately not
``multiprocessing.shared_memory``: its resource tracker (Python 3.11) unlinks segments that a
process merely attached to when that process exits, which would free the engine's KV cache.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat

import numpy as np

from kvxferd.errors import MemoryRegionError, SegmentTooSmallError
from kvxferd.memory.region import MemKind, check_region_name, check_region_size

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class SharedMemoryRegion:
    """A POSIX shared-memory segment mapped into this process (a DRAM :class:`RegionSource`).

    Use :meth:`create` on the owner (engine) side, which unlinks the segment on close, and
    :meth:`attach` on the sidecar side, which never unlinks.
    """

    def __init__(self, name: str, mapping: mmap.mmap, size: int, owner: bool) -> None:
        self._name = name
        self._mmap: mmap.mmap | None = mapping
        self._array: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8, count=size)
        self._size = size
        self._owner = owner
        self._base_addr = int(self._array.ctypes.data)

    @classmethod
    def create(cls, name: str, size: int, *, reserve: bool = True) -> SharedMemoryRegion:
        """Create segment ``name`` of ``size`` bytes (zero-filled); fails if it already exists.

        ``reserve`` allocates the pages now (``posix_fallocate``) so a full ``/dev/shm`` fails
        here with MemoryRegionError instead of SIGBUS on first touch.
        """
        check_region_name(name)
        check_region_size(size)
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise MemoryRegionError(f"shared memory segment {name!r} already exists") from exc
        except OSError as exc:
            raise MemoryRegionError(f"cannot create shared memory segment {name!r}: {exc}") from exc
        try:
            os.ftruncate(fd, size)
            if reserve:
                os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise MemoryRegionError(
                f"cannot size shared memory segment {name!r} to {size} bytes: {exc}"
            ) from exc
        finally:
            os.close(fd)
        return cls(name, mapping, size, owner=True)

    @classmethod
    def attach(cls, name: str, expected_size: int | None = None) -> SharedMemoryRegion:
        """Map existing segment ``name``; map ``expected_size`` bytes (all of it when None).

        Raises MemoryRegionError when the segment is missing or not a plain file (a link
        planted under the name in the world-writable ``/dev/shm`` is refused, never followed to
        a file of ours), SegmentTooSmallError (field ``expected_size``) when it is smaller.
        """
        check_region_name(name)
        if expected_size is not None:
            check_region_size(expected_size, "expected_size")
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError as exc:
            raise MemoryRegionError(
                f"shared memory segment {name!r} does not exist ({_path(name)})"
            ) from exc
        except OSError as exc:
            raise MemoryRegionError(f"cannot open shared memory segment {name!r}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MemoryRegionError(f"shared memory segment {name!r} is not a plain file")
            actual = st.st_size
            size = actual if expected_size is None else expected_size
            if actual < size or actual == 0:
                raise SegmentTooSmallError(
                    "expected_size",
                    f"shared memory segment {name!r} has {actual} bytes, expected at least {size}",
                )
            try:
                mapping = mmap.mmap(fd, size)
            except OSError as exc:
                raise MemoryRegionError(
                    f"cannot map shared memory segment {name!r}: {exc}"
                ) from exc
        finally:
            os.close(fd)
        return cls(name, mapping, size, owner=False)

    @property
    def name(self) -> str:
        """Segment name (no leading slash)."""
        return self._name

    @property
    def size(self) -> int:
        """Mapped bytes."""
        return self._size

    @property
    def mem(self) -> MemKind:
        """Always DRAM."""
        return "DRAM"

    @property
    def device_id(self) -> int:
        """Always 0 for DRAM."""
        return 0

    @property
    def base_addr(self) -> int:
        """Address of the mapping in this process."""
        return self._base_addr

    @property
    def owner(self) -> bool:
        """True on the side that created the segment (and unlinks it on close)."""
        return self._owner

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._mmap is None

    def host_view(self) -> np.ndarray:
        """Writable uint8 view of the whole region."""
        if self._array is None:
            raise MemoryRegionError(f"shared memory region {self._name!r} is closed")
        return self._array

    def backed_bytes(self) -> int:
        """Mapped bytes the segment still holds: fewer than :attr:`size` once its owner
        truncated it (ftruncate), after which touching the pages past them raises SIGBUS here.
        One fstat of the mapping's own descriptor (valid after an unlink too)."""
        if self._mmap is None:
            raise MemoryRegionError(f"shared memory region {self._name!r} is closed")
        return min(self._mmap.size(), self._size)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment. Idempotent.

        Views still held by callers keep the mapping alive until they are dropped.
        """
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        self._array = None
        try:
            mapping.close()
        except BufferError:
            logger.debug("region %s still has views; unmapped when they are dropped", self._name)
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_path(self._name))

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        return (
            f"SharedMemoryRegion({self._name!r}, size={self._size}, {role}, closed={self.closed})"
        )


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def shm_segment(address: int) -> tuple[str, int, int] | None:
    """(name, mapping start, size) of the /dev/shm segment mapped at ``address``, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi and len(fields) > 5 and fields[5].startswith("/dev/shm/"):
                return fields[5][len("/dev/shm/") :], lo, hi - lo
    return None
