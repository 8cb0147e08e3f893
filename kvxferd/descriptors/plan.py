"""ReadPlan: the byte pairs one local rank READs from one remote rank, as flat int64 arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """Descriptor pairs: ``length[k]`` bytes from the remote region ``remote_region[k]`` at
    ``remote_offset[k]`` go to the local region ``local_region[k]`` at ``local_offset[k]``.

    Offsets are from each region's base; the transport adds the registered base addresses.
    ``kv_bytes`` and ``state_bytes`` split the total between attention and mamba groups.
    """

    local_region: np.ndarray
    local_offset: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    length: np.ndarray
    kv_bytes: int
    state_bytes: int

    @property
    def num_descriptors(self) -> int:
        """Descriptor pairs in the plan (one NIXL descriptor on each side per pair)."""
        return int(self.length.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves (``kv_bytes + state_bytes``)."""
        return self.kv_bytes + self.state_bytes

    @classmethod
    def empty(cls) -> ReadPlan:
        """A plan that reads nothing (this remote rank serves nothing to this local rank)."""
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z, z, 0, 0)
