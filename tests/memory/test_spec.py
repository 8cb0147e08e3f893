"""open_region maps what an engine's wire region spec names, on the sidecar side."""

import os
import uuid

import msgspec
import pytest

from kvxferd.errors import MemoryRegionError
from kvxferd.memory import CudaIpcHandle, SharedMemoryRegion, open_region
from kvxferd.wire import AnyRegionSpec, CudaRegionSpec, RegionSpec


@pytest.fixture
def shm_name() -> str:
    return f"kvx-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def test_shm_spec_from_json_attaches_to_the_engines_segment(shm_name):
    with SharedMemoryRegion.create(shm_name, 8192) as owner:
        owner.host_view()[:4] = [1, 2, 3, 4]
        spec = msgspec.json.decode(
            f'{{"type": "shm", "name": "{shm_name}", "size_bytes": 8192}}', type=AnyRegionSpec
        )
        assert spec == RegionSpec(name=shm_name, size_bytes=8192)
        region = open_region(spec)
        try:
            assert region.size == 8192
            assert list(region.host_view()[:4]) == [1, 2, 3, 4]
        finally:
            region.close()


def test_shm_spec_for_a_missing_segment_raises_naming_it():
    with pytest.raises(MemoryRegionError, match="kvxferd-test-no-such-seg"):
        open_region(RegionSpec(name="kvxferd-test-no-such-seg", size_bytes=4096))


def test_cuda_spec_carries_the_handle_as_base64_json_and_fails_clearly_without_cuda():
    handle = CudaIpcHandle(
        device=0, handle=b"\x01" * 64, storage_size=4096, storage_offset=0,
        ref_counter_handle=b"\x02" * 8, ref_counter_offset=0,
    )  # fmt: skip
    spec = CudaRegionSpec(handle=handle.to_bytes(), size_bytes=4096, device_id=0)
    back = msgspec.json.decode(msgspec.json.encode(spec), type=AnyRegionSpec)
    assert back == spec
    with pytest.raises(MemoryRegionError, match="CUDA"):
        open_region(back)
