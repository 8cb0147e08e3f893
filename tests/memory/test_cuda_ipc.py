"""CudaIpcRegion: what can be checked without a GPU (handle wire form, clear errors)."""

from __future__ import annotations

import pytest

from kvxferd.errors import MemoryRegionError
from kvxferd.memory import CudaIpcHandle, CudaIpcRegion, RegionSource

torch = pytest.importorskip("torch")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")

HANDLE = CudaIpcHandle(
    device=1,
    handle=bytes(range(64)),
    storage_size=1 << 20,
    storage_offset=4096,
    ref_counter_handle=b"/torch_123_456_0",
    ref_counter_offset=3,
    event_handle=b"\x00" * 64,
    event_sync_required=True,
)


def test_handle_round_trips_through_bytes_and_base64():
    assert CudaIpcHandle.from_bytes(HANDLE.to_bytes()) == HANDLE
    text = HANDLE.to_base64()
    assert text.isascii()
    assert CudaIpcHandle.from_base64(text) == HANDLE


def test_handle_without_event_round_trips():
    h = CudaIpcHandle(
        device=0,
        handle=b"h",
        storage_size=8,
        storage_offset=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
    )
    assert CudaIpcHandle.from_bytes(h.to_bytes()) == h
    assert h.event_handle is None


@pytest.mark.parametrize("junk", [b"", b"\xc1", b"\x80"])
def test_malformed_handle_bytes_raise_memory_region_error(junk):
    with pytest.raises(MemoryRegionError, match="malformed CUDA IPC handle"):
        CudaIpcHandle.from_bytes(junk)


def test_malformed_base64_raises_memory_region_error():
    with pytest.raises(MemoryRegionError, match="base64"):
        CudaIpcHandle.from_base64("not base64!")


@no_cuda
def test_open_without_cuda_says_cuda_not_available():
    with pytest.raises(MemoryRegionError, match="CUDA not available"):
        CudaIpcRegion.open("kv0", HANDLE.to_bytes(), 1 << 20, 1)


@no_cuda
def test_export_without_cuda_says_cuda_not_available():
    with pytest.raises(MemoryRegionError, match="CUDA not available"):
        CudaIpcRegion.export(torch.zeros(4), "kv0")


def test_open_checks_device_and_size_before_touching_cuda():
    with pytest.raises(MemoryRegionError, match="device 1, spec says 0"):
        CudaIpcRegion.open("kv0", HANDLE, 1 << 20, 0)
    with pytest.raises(MemoryRegionError, match=r"covers 1048576 bytes, expected 1048577"):
        CudaIpcRegion.open("kv0", HANDLE, (1 << 20) + 1, 1)


class _Storage:
    """Stands in for a CUDA storage: only size and pointer are read."""

    def nbytes(self) -> int:
        return 1 << 20

    def data_ptr(self) -> int:
        return 0x7F0000000000


def test_region_reports_vram_geometry_and_has_no_host_view():
    region = CudaIpcRegion("kv0", _Storage(), HANDLE, owner=False)
    assert isinstance(region, RegionSource)
    assert (region.mem, region.device_id, region.size, region.base_addr) == (
        "VRAM",
        1,
        1 << 20,
        0x7F0000000000,
    )
    with pytest.raises(MemoryRegionError, match="VRAM"):
        region.host_view()
    region.close()
    region.close()
    assert region.closed
