"""The simulated engine's KV memory: per TP rank, the planner's manifest and one POSIX
shared-memory segment per pooled region (what the rank's sidecar registers with NIXL).

Segment names carry the engine id, so two sims on one host never collide. Once every sidecar
has attached, :meth:`RankPool.unlink` drops the names: the memory lives on in the mappings, and
nothing is left in ``/dev/shm`` even if the engine is killed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any

import numpy as np

from kvxferd.layout import PlanOptions, plan_manifest
from kvxferd.memory import SharedMemoryRegion
from kvxferd.memory.shm import SHM_DIR
from kvxferd.wire import Manifest, RegionSpec

DEFAULT_POOL_BYTES = 1 << 30
"""Default budget of all ranks' pools together when --pool-blocks is not given."""
MAX_DEFAULT_BLOCKS = 4096


class RankPool:
    """One rank's pooled KV regions in shared memory, zero-filled and mapped here."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.segments: list[SharedMemoryRegion] = []
        try:
            for r in manifest.regions:
                self.segments.append(SharedMemoryRegion.create(r.name, r.size_bytes))
        except BaseException:
            self.close()
            raise
        self.views: list[np.ndarray] = [s.host_view() for s in self.segments]

    def specs(self) -> list[RegionSpec]:
        """Where the sidecar finds each region (same order as the manifest's)."""
        return [RegionSpec(name=r.name, size_bytes=r.size_bytes) for r in self.manifest.regions]

    def unlink(self) -> None:
        """Remove the segment names; mappings (ours, the sidecar's) stay valid."""
        for r in self.manifest.regions:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, r.name))

    def close(self) -> None:
        """Unmap and unlink every segment. Idempotent."""
        self.views = []
        for s in self.segments:
            s.close()


def plan_ranks(hf_config: dict[str, Any], options: PlanOptions) -> list[Manifest]:
    """The manifest of every rank of a ``options.tp_size`` engine (``tp_rank`` is overridden)."""
    return [plan_manifest(hf_config, replace(options, tp_rank=r)) for r in range(options.tp_size)]


def block_bytes(manifests: list[Manifest]) -> int:
    """Bytes one logical block costs over all ranks and regions."""
    return sum(r.page_bytes for m in manifests for r in m.regions)


def default_pool_blocks(
    hf_config: dict[str, Any], options: PlanOptions, budget_bytes: int = DEFAULT_POOL_BYTES
) -> int:
    """Blocks that fit ``budget_bytes`` over all ranks (at least two per group plus the null
    block, at most MAX_DEFAULT_BLOCKS)."""
    probe = plan_ranks(hf_config, replace(options, num_blocks=2))
    floor = 2 * len(probe[0].groups) + 1
    return max(floor, min(MAX_DEFAULT_BLOCKS, budget_bytes // max(1, block_bytes(probe))))
