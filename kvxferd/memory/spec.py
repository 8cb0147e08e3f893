"""The sidecar-side opener of the region specs an engine sends (``kvxferd.wire`` types)."""

from __future__ import annotations

from kvxferd.errors import MemoryRegionError
from kvxferd.memory.cuda_ipc import CudaIpcRegion
from kvxferd.memory.region import RegionSource
from kvxferd.memory.shm import SharedMemoryRegion
from kvxferd.wire import AnyRegionSpec, CudaRegionSpec, RegionSpec


def open_region(spec: AnyRegionSpec, name: str = "") -> RegionSource:
    """Map the region ``spec`` describes (attach; never creates). ``name`` labels VRAM regions."""
    if isinstance(spec, RegionSpec):
        return SharedMemoryRegion.attach(spec.name, spec.size_bytes)
    if isinstance(spec, CudaRegionSpec):
        label = name or f"cuda{spec.device_id}"
        return CudaIpcRegion.open(label, spec.handle, spec.size_bytes, spec.device_id)
    raise MemoryRegionError(f"unknown region spec type {type(spec).__name__}")
