"""Memory regions the sidecar maps: POSIX shared memory (DRAM) and CUDA IPC (VRAM)."""

from kvxferd.memory.cuda_ipc import CudaIpcHandle, CudaIpcRegion
from kvxferd.memory.region import (
    MAX_NAME_LEN,
    MemKind,
    RegionSource,
    check_region_name,
    check_region_size,
    first_shrunk,
)
from kvxferd.memory.shm import SHM_DIR, SharedMemoryRegion, shm_segment
from kvxferd.memory.spec import check_sources, open_region

__all__ = [
    "MAX_NAME_LEN",
    "SHM_DIR",
    "CudaIpcHandle",
    "CudaIpcRegion",
    "MemKind",
    "RegionSource",
    "SharedMemoryRegion",
    "check_region_name",
    "check_sources",
    "check_region_size",
    "first_shrunk",
    "open_region",
    "shm_segment",
]
