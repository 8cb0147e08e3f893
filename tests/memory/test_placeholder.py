"""Zero pages where a shared-memory source was: a late reader of the addresses gets zeros,
never the segment's bytes, and the addresses stay taken until the zero pages are vacated."""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid

import pytest

from kvxferd.memory import SharedMemoryRegion
from kvxferd.memory.placeholder import close_leaving_zeros, occupy

SIZE = 3 * mmap.PAGESIZE + 100  # not a whole number of pages


@pytest.fixture
def owner():
    region = SharedMemoryRegion.create(f"kvx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", SIZE)
    region.host_view()[:] = 0xA5
    yield region
    region.close()


def test_a_closed_segment_leaves_zero_pages_at_its_addresses_and_the_segment_keeps_its_bytes(
    owner,
):
    sidecar = SharedMemoryRegion.attach(owner.name, SIZE)
    address = sidecar.base_addr
    placeholder = close_leaving_zeros(sidecar)
    assert placeholder is not None and sidecar.closed
    assert (placeholder.address, placeholder.length) == (address, 4 * mmap.PAGESIZE)
    assert ctypes.string_at(address, SIZE) == bytes(SIZE)  # zeros, not the engine's 0xA5
    assert bytes(owner.host_view()[:SIZE]) == b"\xa5" * SIZE
    assert occupy(address, SIZE) is None  # the addresses stay taken
    placeholder.vacate()
    again = occupy(address, SIZE)  # free once vacated
    assert again is not None
    again.vacate()


def test_a_segment_still_viewed_stays_mapped_and_gets_no_zero_pages(owner):
    sidecar = SharedMemoryRegion.attach(owner.name, SIZE)
    view = sidecar.host_view()  # a store copy still holding the memory
    assert close_leaving_zeros(sidecar) is None
    assert sidecar.closed and int(view[SIZE - 1]) == 0xA5  # still the segment's bytes
    del view


def test_a_closed_source_gets_no_zero_pages(owner):
    sidecar = SharedMemoryRegion.attach(owner.name, SIZE)
    sidecar.close()
    assert close_leaving_zeros(sidecar) is None


def test_occupy_takes_no_address_already_mapped(owner):
    assert occupy(owner.base_addr, SIZE) is None
    assert owner.host_view()[0] == 0xA5  # the mapping there is untouched
