"""A region registered with a NIXL agent, and the agent's live-handle counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(eq=False)
class Registration:
    """One region registered once with NIXL (``Agent.register``); pass to ``Agent.deregister``."""

    name: str
    """Region name (for messages)."""
    base_addr: int
    """Address of the region in this process."""
    size: int
    """Registered bytes."""
    mem: str
    """NIXL memory type: DRAM or VRAM."""
    device_id: int
    """GPU index (0 for DRAM)."""
    dlist: Any = field(repr=False, default=None)
    """NIXL's registration descriptor list (None once deregistered)."""

    @property
    def live(self) -> bool:
        """Whether the region is still registered."""
        return self.dlist is not None

    def key(self) -> tuple[str, int, int]:
        """Identity of the registered bytes: (mem, device, base address)."""
        return (self.mem, self.device_id, self.base_addr)


class LiveHandles(NamedTuple):
    """What an agent still holds; all zero after everything was released."""

    transfers: int
    """Transfer handles not yet released."""
    prepped: int
    """Prepped descriptor lists not yet released."""
    registrations: int
    """Regions still registered."""
    remotes: int
    """Remote agents whose metadata is loaded."""
