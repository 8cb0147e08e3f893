"""open_region maps what an engine's wire region spec names, on the sidecar side; check_sources
holds each manifest region to its source's memory."""

import os
import uuid

import msgspec
import pytest

from kvxferd.errors import ManifestError, MemoryRegionError
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.memory import CudaIpcHandle, SharedMemoryRegion, open_region
from kvxferd.memory.spec import check_sources
from kvxferd.wire import AnyRegionSpec, CudaRegionSpec, RegionSpec, RegisterRequest

GRANITE = plan_manifest(load_hf_config("granite-4.0-h-tiny"), PlanOptions(num_blocks=4))


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


def _register(manifest_memory: list[tuple[str, int]], sources: list[AnyRegionSpec]):
    """A register request: GRANITE's regions in ``manifest_memory``, one source each."""
    regions = [
        msgspec.structs.replace(r, mem=mem, device_id=dev, source=i, source_offset=0)
        for i, (r, (mem, dev)) in enumerate(zip(GRANITE.regions, manifest_memory, strict=False))
    ]
    manifest = msgspec.structs.replace(GRANITE, regions=regions)
    return RegisterRequest(manifest=manifest, regions=sources)


def _cuda(device: int, size: int) -> CudaRegionSpec:
    return CudaRegionSpec(handle=b"\x01" * 64, size_bytes=size, device_id=device)


@pytest.mark.parametrize(
    ("said", "source", "named"),
    [
        (("VRAM", 0), "shm", "manifest.regions[0].mem"),  # shared memory said to be VRAM
        (("DRAM", 0), "cuda0", "manifest.regions[0].mem"),  # GPU memory said to be DRAM
        (("VRAM", 0), "cuda1", "manifest.regions[0].mem"),  # on another GPU than said
        (("VRAM", 1), "cuda1", None),
        (("DRAM", 0), "shm", None),
    ],
)
def test_each_regions_memory_is_its_sources(said, source, named):
    """READs name each region's memory as the manifest says, while NIXL registers a source as
    what it is: a mismatch would fail every pull, so the register is refused naming it."""
    size = max(r.size_bytes for r in GRANITE.regions)
    spec = {"shm": RegionSpec(name="kvx-t", size_bytes=size), "cuda0": _cuda(0, size),
            "cuda1": _cuda(1, size)}[source]  # fmt: skip
    n = len(GRANITE.regions)
    req = _register([said] * n, [spec] * n)
    if named is None:
        assert check_sources(req) == list(range(n))
    else:
        with pytest.raises(ManifestError) as err:
            check_sources(req)
        assert err.value.field == named
