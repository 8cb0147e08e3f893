"""SharedMemoryRegion: the engine creates and owns a segment; the sidecar attaches by name."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest

from kvxferd.errors import MemoryRegionError, SegmentTooSmallError
from kvxferd.memory import SHM_DIR, RegionSource, SharedMemoryRegion


def _name() -> str:
    return f"kvx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def owner():
    region = SharedMemoryRegion.create(_name(), 1 << 16)
    yield region
    region.close()


def test_created_region_is_zeroed_dram_with_base_address_of_its_bytes(owner):
    assert isinstance(owner, RegionSource)
    assert (owner.mem, owner.device_id, owner.size, owner.owner) == ("DRAM", 0, 1 << 16, True)
    view = owner.host_view()
    assert view.dtype == np.uint8 and view.shape == (1 << 16,)
    assert not view.any()
    view[:4] = [1, 2, 3, 4]
    assert ctypes.string_at(owner.base_addr, 4) == b"\x01\x02\x03\x04"


def test_attached_mapping_sees_owner_writes_and_writes_back(owner):
    owner.host_view()[100:108] = np.arange(8, dtype=np.uint8)
    with SharedMemoryRegion.attach(owner.name, owner.size) as peer:
        assert peer.owner is False
        assert peer.base_addr != owner.base_addr
        assert peer.host_view()[100:108].tolist() == list(range(8))
        peer.host_view()[0] = 0xEE
    assert owner.host_view()[0] == 0xEE


def test_attach_without_size_maps_the_whole_segment(owner):
    with SharedMemoryRegion.attach(owner.name) as peer:
        assert peer.size == owner.size


def test_attach_smaller_than_segment_maps_only_expected_size(owner):
    with SharedMemoryRegion.attach(owner.name, 4096) as peer:
        assert peer.size == 4096 and peer.host_view().shape == (4096,)


def test_attached_close_keeps_segment_owner_close_unlinks():
    owner = SharedMemoryRegion.create(_name(), 4096)
    path = os.path.join(SHM_DIR, owner.name)
    SharedMemoryRegion.attach(owner.name, 4096).close()
    assert os.path.exists(path)
    owner.close()
    assert not os.path.exists(path)


def test_attach_missing_segment_names_it():
    name = _name()
    with pytest.raises(MemoryRegionError, match=f"{name}.*does not exist"):
        SharedMemoryRegion.attach(name, 4096)


def test_attach_too_small_segment_gives_both_sizes(owner):
    with pytest.raises(SegmentTooSmallError, match=r"has 65536 bytes, expected at least 65537"):
        SharedMemoryRegion.attach(owner.name, owner.size + 1)


def test_backed_bytes_fall_when_the_owner_truncates_the_segment_even_unlinked(owner):
    path = os.path.join(SHM_DIR, owner.name)
    fd = os.open(path, os.O_RDWR)  # the owner's own handle on the segment
    try:
        with SharedMemoryRegion.attach(owner.name, owner.size) as peer:
            assert peer.backed_bytes() == owner.size
            os.unlink(path)  # as the sim does once every sidecar attached
            os.ftruncate(fd, 4096)  # from here, touching the mapping past 4096 B is SIGBUS
            assert peer.backed_bytes() == 4096
    finally:
        os.close(fd)
    with pytest.raises(MemoryRegionError, match="closed"):
        peer.backed_bytes()


def test_create_existing_name_fails_and_leaves_segment_alone(owner):
    owner.host_view()[0] = 7
    with pytest.raises(MemoryRegionError, match="already exists"):
        SharedMemoryRegion.create(owner.name, 4096)
    assert owner.host_view()[0] == 7


@pytest.mark.parametrize("bad", ["", "a/b", "/lead", "..", ".", "sp ace", "x" * 201])
def test_invalid_names_are_rejected(bad):
    with pytest.raises(MemoryRegionError, match="region name"):
        SharedMemoryRegion.create(bad, 4096)


@pytest.mark.parametrize("bad", ["seg\n", "..\n"])
def test_names_with_a_trailing_newline_are_rejected(bad):
    with pytest.raises(MemoryRegionError, match="region name"):
        SharedMemoryRegion.attach(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_sizes_are_rejected(bad):
    with pytest.raises(MemoryRegionError, match="positive int"):
        SharedMemoryRegion.create(_name(), bad)


def test_close_is_idempotent_and_views_fail_after(owner):
    owner.close()
    owner.close()
    assert owner.closed
    with pytest.raises(MemoryRegionError, match="closed"):
        owner.host_view()


def test_close_with_a_live_view_still_unlinks():
    owner = SharedMemoryRegion.create(_name(), 4096)
    view = owner.host_view()[:16]
    owner.close()
    assert not os.path.exists(os.path.join(SHM_DIR, owner.name))
    view[0] = 1  # mapping stays valid while the caller's view lives
    assert view[0] == 1


def _child_attach_write_exit(name: str, size: int) -> None:
    region = SharedMemoryRegion.attach(name, size)
    region.host_view()[-1] = 0x5A
    region.close()


def test_a_process_that_attached_and_exited_does_not_unlink_the_segment(owner):
    child = mp.get_context("spawn").Process(
        target=_child_attach_write_exit, args=(owner.name, owner.size)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert os.path.exists(os.path.join(SHM_DIR, owner.name))
    assert owner.host_view()[-1] == 0x5A


def test_attach_refuses_a_link_planted_under_the_name(tmp_path):
    """/dev/shm is world-writable: a link there must not map some other file of ours."""
    mine = tmp_path / "private"
    mine.write_bytes(b"secret" * 1000)
    link = os.path.join(SHM_DIR, _name())
    os.symlink(mine, link)
    try:
        with pytest.raises(MemoryRegionError, match="cannot open"):
            SharedMemoryRegion.attach(os.path.basename(link), 4096)
    finally:
        os.unlink(link)
