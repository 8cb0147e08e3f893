"""Retired: unregistered generations' addresses stay occupied by zero pages, a bounded number
of generations, all unmapped at close."""

from __future__ import annotations

import ctypes
import os
import uuid

from kvxferd.memory import SharedMemoryRegion
from kvxferd.memory.placeholder import occupy
from kvxferd.sidecar.sources import Retired

SIZE = 1 << 16


def _generation() -> tuple[SharedMemoryRegion, SharedMemoryRegion]:
    """An engine's segment (filled) and the sidecar's mapping of it."""
    owner = SharedMemoryRegion.create(f"kvx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", SIZE)
    owner.host_view()[:] = 7
    return owner, SharedMemoryRegion.attach(owner.name, SIZE)


def _free(address: int) -> bool:
    """Whether nothing is mapped at ``address`` (checked by mapping there, then unmapping)."""
    taken = occupy(address, SIZE)
    if taken is not None:
        taken.vacate()
    return taken is not None


def test_retired_generations_beyond_the_bound_are_unmapped_oldest_first():
    retired = Retired(keep=2)
    pairs = [_generation() for _ in range(3)]
    addresses = [sidecar.base_addr for _, sidecar in pairs]
    try:
        for _, sidecar in pairs:
            retired.retire([sidecar])
        assert retired.generations == 2
        assert _free(addresses[0])
        assert not any(_free(a) for a in addresses[1:])
        assert all(ctypes.string_at(a, SIZE) == bytes(SIZE) for a in addresses[1:])
    finally:
        retired.close()
        for owner, _ in pairs:
            owner.close()
    assert retired.generations == 0
    assert all(_free(a) for a in addresses)
