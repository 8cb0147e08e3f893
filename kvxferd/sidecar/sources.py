"""An engine registration's memory sources as this sidecar holds them: mapped here, registered
with NIXL once each, the base address of every manifest region, and the host views the store
copies. The Sidecar keeps what :func:`map_sources` returns for as long as the registration
lasts and gives it back with :func:`release_sources`, which leaves zero pages where the memory
was (:class:`Retired`: a READ its UCX worker still serves must find them)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvxferd.errors import MemoryInUseError
from kvxferd.memory import open_region
from kvxferd.memory.placeholder import Placeholder, close_leaving_zeros
from kvxferd.sidecar.offload import STOP_S
from kvxferd.sidecar.reads import QUARANTINE_S
from kvxferd.transport import Agent
from kvxferd.wire import Manifest, RegisterRequest

log = logging.getLogger(__name__)

RETIRED_GENERATIONS = 8
"""Unregistered generations whose addresses stay occupied by zero pages (older ones are
unmapped, oldest first): a READ stalled across this many unregisters is past any bound."""


class Retired:
    """Zero pages where unregistered generations' memory was mapped, until shutdown.

    Why: over UCX's TCP transport this sidecar's own UCX worker serves a reader's READ, copying
    from the registered memory as its socket drains; a reader stalled mid-READ past its claim
    leaves those copies queued after the unregister (nothing in NIXL or UCX stops them). Had
    the memory just been unmapped, the copies resumed with the reader and this sidecar died of
    SIGSEGV (``kvxferd.memory.placeholder``). Zero pages cost no memory (the kernel's shared
    zero page) and keep the engine's memory released; bounded to ``RETIRED_GENERATIONS``
    generations' address space, all unmapped by :meth:`close` (after the agent closed)."""

    def __init__(self, keep: int = RETIRED_GENERATIONS) -> None:
        self._keep = keep
        self._generations: deque[list[Placeholder]] = deque()

    @property
    def generations(self) -> int:
        """Generations whose zero pages are still mapped."""
        return len(self._generations)

    def retire(self, regions: list[Any]) -> None:
        """Close ``regions``, leaving zero pages where their mappings were."""
        kept = [p for p in map(close_leaving_zeros, regions) if p is not None]
        self._generations.append(kept)
        while len(self._generations) > self._keep:
            oldest = self._generations.popleft()
            if oldest:  # a READ still queued on them (stalled this long) would fault now
                log.info("unmapping the zero pages of the oldest unregistered generation "
                         "(%d kept)", self._keep)  # fmt: skip
            for placeholder in oldest:
                placeholder.vacate()

    def close(self) -> None:
        """Unmap every zero page (no UCX worker may read them any more: the agent closed)."""
        while self._generations:
            for placeholder in self._generations.popleft():
                placeholder.vacate()


async def map_sources(
    agent: Agent, req: RegisterRequest, sources: Sequence[int]
) -> tuple[list[Any], list[Any], list[int]]:
    """Map ``req``'s sources and register them with NIXL (on a thread: it blocks for
    milliseconds): ``(regions, registrations, bases)``, ``bases[i]`` the address of manifest
    region ``i`` (``sources`` as ``check_sources`` gave them). All or nothing: what was mapped
    is unmapped if any step fails."""
    regions: list[Any] = []
    try:
        for i, spec in enumerate(req.regions):
            regions.append(open_region(spec, field=f"regions[{i}]"))
        registrations = await asyncio.to_thread(agent.register, regions)
    except BaseException:
        close_sources(regions)
        raise
    bases = [
        regions[src].base_addr + region.source_offset
        for src, region in zip(sources, req.manifest.regions, strict=True)
    ]
    return regions, registrations, bases


async def release_sources(
    agent: Agent, registrations: list[Any], regions: list[Any], retired: Retired
) -> None:
    """Drop the NIXL registrations (no new READ of the memory), then unmap the sources,
    leaving zero pages in ``retired`` where they were (READs already queued may copy them)."""
    for reg in registrations:
        await asyncio.to_thread(agent.deregister, reg)
    retired.retire(regions)


async def drop_sources(agent: Agent, registrations: list[Any], regions: list[Any]) -> None:
    """Drop the NIXL registrations and unmap the sources of memory no READ was ever allowed
    (a pod rank's register that timed out before its pod was complete)."""
    for reg in registrations:
        await asyncio.to_thread(agent.deregister, reg)
    close_sources(regions)


def check_let_go(claims_left_s: Sequence[float], unsettled: int, copying: int) -> None:
    """MemoryInUseError (503: retry) while an unregistering engine's memory may still be used
    after its pulls and holds ended: by decodes that claimed holds (``claims_left_s``, each
    claim's time left), READs still unsettled, or store loads or saves still copying."""
    if claims_left_s:
        raise MemoryInUseError(
            f"unregister: {len(claims_left_s)} holds may still be read by decodes that claimed "
            f"them, so it stays registered (pulls ended, holds take no claim); retry after "
            f"their claims end (at most {max(max(claims_left_s), 0.0):.0f} s)"
        )
    if unsettled:
        raise MemoryInUseError(
            f"unregister: {unsettled} READs still unsettled may write this memory, so it stays "
            f"registered (pulls and holds ended); retry after they end (at most "
            f"{QUARANTINE_S:g} s)"
        )
    if copying:
        raise MemoryInUseError(
            f"unregister: {copying} store loads or saves still copy this memory after "
            f"{STOP_S:g} s, so it stays registered (pulls and holds ended); retry"
        )


def close_sources(regions: list[Any]) -> None:
    """Unmap every source."""
    for region in regions:
        region.close()


def host_views(regions: list[Any], sources: Sequence[int], manifest: Manifest) -> list[Any]:
    """A host view of each manifest region's bytes inside its source (for the store)."""
    views = [region.host_view() for region in regions]
    return [
        views[src][r.source_offset : r.source_offset + r.size_bytes]
        for src, r in zip(sources, manifest.regions, strict=True)
    ]


__all__ = [
    "RETIRED_GENERATIONS",
    "Retired",
    "check_let_go",
    "close_sources",
    "drop_sources",
    "host_views",
    "map_sources",
    "release_sources",
]
