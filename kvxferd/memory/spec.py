"""The sidecar-side opener of the region specs an engine sends (``kvxferd.wire`` types)."""

from __future__ import annotations

from kvxferd.errors import ManifestError, MemoryRegionError, SegmentTooSmallError
from kvxferd.memory.cuda_ipc import CudaIpcRegion
from kvxferd.memory.region import RegionSource
from kvxferd.memory.shm import SharedMemoryRegion
from kvxferd.wire import AnyRegionSpec, CudaRegionSpec, RegionSpec, RegisterRequest


def open_region(spec: AnyRegionSpec, name: str = "", field: str = "region") -> RegionSource:
    """Map the region ``spec`` describes (attach; never creates). ``name`` labels VRAM regions;
    a segment smaller than ``spec.size_bytes`` is a SegmentTooSmallError naming
    ``{field}.size_bytes``."""
    if isinstance(spec, RegionSpec):
        try:
            return SharedMemoryRegion.attach(spec.name, spec.size_bytes)
        except SegmentTooSmallError as exc:
            raise SegmentTooSmallError(f"{field}.size_bytes", exc.reason) from None
    if isinstance(spec, CudaRegionSpec):
        label = name or f"cuda{spec.device_id}"
        return CudaIpcRegion.open(label, spec.handle, spec.size_bytes, spec.device_id)
    raise MemoryRegionError(f"unknown region spec type {type(spec).__name__}")


def check_sources(req: RegisterRequest) -> list[int]:
    """The source index of each manifest region, checked to lie inside its allocation.

    A region with ``source == -1`` is its own source (one allocation per region, the same index);
    otherwise it is ``source_offset`` bytes into ``req.regions[source]`` (vLLM's one backing
    buffer per worker, many regions). Each region's memory (``mem``, ``device_id``) must be its
    source's: shared memory is DRAM, a CUDA IPC source VRAM on its device. Raises ManifestError
    naming the field.
    """
    regions = req.manifest.regions
    legacy = all(r.source < 0 for r in regions)
    if legacy and len(req.regions) != len(regions):
        raise ManifestError(
            "regions", f"{len(req.regions)} region sources for {len(regions)} regions"
        )
    out = []
    for i, region in enumerate(regions):
        src = i if region.source < 0 else region.source
        if not 0 <= src < len(req.regions):
            raise ManifestError(f"manifest.regions[{i}].source", f"no source {src}")
        if region.source_offset < 0:
            raise ManifestError(f"manifest.regions[{i}].source_offset", "must not be negative")
        end = region.source_offset + region.size_bytes
        if end > req.regions[src].size_bytes:
            field = "size_bytes" if legacy else "source_offset"
            raise ManifestError(
                f"regions[{i}].{field}" if legacy else f"manifest.regions[{i}].{field}",
                f"{req.regions[src].size_bytes} < manifest region size {region.size_bytes}"
                if legacy
                else f"region ends at {end}, past source {src} ({req.regions[src].size_bytes} B)",
            )
        spec = req.regions[src]
        # READs name each region's memory as the manifest says; NIXL registered the source
        # as what it really is, and a mismatch would fail every pull (NIXL_ERR_NOT_FOUND).
        real = ("DRAM", 0) if isinstance(spec, RegionSpec) else ("VRAM", spec.device_id)
        if (region.mem, region.device_id) != real:
            raise ManifestError(
                f"manifest.regions[{i}].mem",
                f"{region.mem} on device {region.device_id}, but its source is {real[0]}"
                + (f" on device {real[1]}" if real[0] == "VRAM" else ""),
            )
        out.append(src)
    return out
