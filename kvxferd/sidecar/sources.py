"""An engine registration's memory sources as this sidecar holds them: mapped here, registered
with NIXL once each, the base address of every manifest region, and the host views the store
copies. The Sidecar keeps what :func:`map_sources` returns for as long as the registration
lasts and gives it back with :func:`release_sources`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvxferd.memory import open_region
from kvxferd.transport import Agent
from kvxferd.wire import Manifest, RegisterRequest


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


async def release_sources(agent: Agent, registrations: list[Any], regions: list[Any]) -> None:
    """Drop the NIXL registrations, then unmap the sources."""
    for reg in registrations:
        await asyncio.to_thread(agent.deregister, reg)
    close_sources(regions)


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


__all__ = ["close_sources", "host_views", "map_sources", "release_sources"]
