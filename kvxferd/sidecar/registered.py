"""The engine registration a sidecar serves (manifest, holds, generation, mapped memory) and the
gates every call passes before it uses them: one owner, so each check reads the same state."""

from __future__ import annotations

import logging
from typing import Any

from kvxferd import descriptors
from kvxferd.errors import (
    NotRegisteredError,
    PodConflictError,
    SegmentTooSmallError,
    StaleGenerationError,
)
from kvxferd.memory import first_shrunk
from kvxferd.sidecar.holds import HoldTable
from kvxferd.sidecar.pod import Pod, RankMemory
from kvxferd.sidecar.sources import host_views
from kvxferd.wire import Manifest

log = logging.getLogger(__name__)


class Registered:
    """What the registered engine left with this sidecar and the checks on it (generation -1
    while no engine is registered). ``leaving`` is set while an unregister lets it go."""

    def __init__(self, pod: Pod | None) -> None:
        self.pod = pod
        self.manifest: Manifest | None = None
        self.holds: HoldTable | None = None
        self.generation = -1  # registration generation; -1 while no engine is registered
        self.instance = ""  # the registered engine's RegisterRequest.instance
        self.regions: list[Any] = []
        self.bases: list[int] = []
        self.sources: list[int] = []  # source (allocation) index of each manifest region
        self.registrations: list[Any] = []  # NIXL registrations of the memory sources
        self.leaving = False  # an unregister is letting the memory go: refuse new work on it
        self._shrunk: tuple[str, str] | None = None  # (field, why) once a segment shrank

    def adopt(self, memory: RankMemory, manifest: Manifest, generation: int) -> None:
        """Take mapped and registered ``memory`` as registration ``generation`` (its holds
        table is set next, by the Sidecar)."""
        self.regions, self.registrations, self.bases = (memory.regions, memory.registrations,
                                                        memory.bases)  # fmt: skip
        self.sources, self._shrunk = memory.sources, None
        self.generation, self.instance = generation, memory.instance
        self.manifest = manifest

    def forget(self) -> None:
        """No engine is registered any more (its memory was let go; the holds stay, their
        released feed still read)."""
        self.regions, self.registrations, self.bases = [], [], []
        self.manifest = None
        self.generation = -1
        self.instance = ""

    def require_engine(self) -> tuple[HoldTable, Manifest]:
        if self.manifest is None or self.holds is None:
            raise NotRegisteredError("no engine has registered with this sidecar yet")
        if self.leaving:
            raise NotRegisteredError("the engine is unregistering: its memory is being let go")
        return self.holds, self.manifest

    def require_reader(self, generation: int | None) -> None:
        """:meth:`require_engine` and :meth:`check_generation` of a sidecar that may pull (a
        rank's own: a prefill pod's only holds)."""
        self.require_engine()
        self.check_generation(generation)
        if self.pod is not None:
            raise PodConflictError("tickets", f"a prefill pod sidecar (--pod-ranks "
                                   f"{self.pod.ranks}) does not pull; a decode rank pulls "
                                   "through its own")  # fmt: skip

    def check_generation(self, generation: int | None) -> None:
        """Refuse an engine call whose block ids mean an earlier registration's memory (None:
        unchecked): an engine that registered since (two given one socket) would be written."""
        if generation is not None and generation != self.generation:
            raise StaleGenerationError(f"generation: {generation} is not the registered "
                                       f"{self.generation} (registered again since)")  # fmt: skip

    def require_memory(self) -> tuple[HoldTable, Manifest]:
        """:meth:`require_engine`, and the engine's memory still all there (for work that
        touches it or lets a READ touch it)."""
        out = self.require_engine()
        self.check_memory()
        return out

    def check_memory(self) -> None:
        """SegmentTooSmallError, from the first time a registered segment is seen shrunk until
        the engine registers again: a store copy (or a READ over TCP) touching its missing pages
        would kill this process (SIGBUS). One fstat per source; not caught: a truncation during
        a copy that passed this check."""
        if self._shrunk is None:
            self._shrunk = first_shrunk(self.regions)
            if self._shrunk is not None:
                log.error("registered memory %s", ": ".join(self._shrunk))
        if self._shrunk is not None:
            raise SegmentTooSmallError(*self._shrunk)

    def store_target(self, generation: int | None, tp_rank: int) -> tuple[Manifest, list[Any]]:
        """The registered manifest and a host view of each region, for the store (a pod's:
        rank ``tp_rank``'s, :meth:`Pod.store_target`)."""
        _, manifest = self.require_engine()
        self.check_generation(generation)
        if self.pod is not None:
            return self.pod.store_target(tp_rank)
        return manifest, host_views(self.regions, self.sources, manifest)

    def pinning(self, hold_id: str, tp_rank: int) -> tuple[list[list[int]], int, Any]:
        """``HoldTable.pinning`` for a store save by ``hold_id``; on a pod, only once rank
        ``tp_rank`` placed it (its blocks are not pinned before)."""
        out = self.require_engine()[0].pinning(hold_id)
        if self.pod is not None:
            self.pod.placements.check_rank(hold_id, tp_rank)
        return out

    def host_views(self) -> list[Any] | None:
        """A uint8 host view of each registered region, for a staged READ's scatter (None for
        VRAM and for a pod, whose READs are never staged)."""
        _, manifest = self.require_engine()
        if self.pod is not None or any(r.mem != "DRAM" for r in manifest.regions):
            return None
        return host_views(self.regions, self.sources, manifest)

    def local_layout(self) -> tuple[Manifest, list[int]]:
        """The registered manifest and region bases (what a pull reads into)."""
        _, manifest = self.require_engine()
        return manifest, self.bases

    def compare(self, remote: Manifest) -> dict[str, tuple[object, object]]:
        """Every field that keeps ``remote`` from exchanging blocks with the registered manifest
        (PeerTable's compatibility check of a peer)."""
        _, manifest = self.require_engine()
        return descriptors.compare_manifests(manifest, remote)


__all__ = ["Registered"]
