"""What a pull needs that does not depend on the request, computed once per peer epoch.

Rank ownership (which prefill ranks this decode rank reads from, and which no decode rank reads)
depends only on the local registration and the prefill's TP size; the prepared descriptor lists
of a peer pair (the seed-004 views, :mod:`kvxferd.descriptors.prepped`) on the registration and
the peer's epoch. Both are keyed by the registered manifest's identity, so a re-registration
starts afresh.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvxferd import descriptors
from kvxferd.errors import KvxferdError
from kvxferd.sidecar.pull_request import unread_ranks
from kvxferd.wire import Manifest

if TYPE_CHECKING:
    from kvxferd.sidecar.peers import Peer
    from kvxferd.transport.base import PostedRead, Transport

log = logging.getLogger(__name__)

_KEEP = 64  # (registration, prefill TP) pairs remembered


@dataclass(frozen=True)
class RankPlan:
    """The prefill ranks one pull touches, for one (registration, prefill TP size)."""

    sources: tuple[int, ...]
    """Ranks this rank READs from (and notifies)."""
    unread: tuple[int, ...]
    """Ranks no decode rank reads from, released by this rank (decode rank 0 only)."""


class RankPlans:
    """A bounded cache of :class:`RankPlan` by (registered manifest, prefill TP size)."""

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple[int, int], tuple[Manifest, RankPlan]] = OrderedDict()

    def get(self, local: Manifest, remote_tp: int) -> RankPlan:
        """The plan for this registration and prefill TP (computed on first use)."""
        key = (id(local), remote_tp)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is local:
            self._plans.move_to_end(key)
            return hit[1]
        plan = RankPlan(
            tuple(descriptors.source_ranks(local, remote_tp)),
            tuple(unread_ranks(local, remote_tp)),
        )
        self._plans[key] = (local, plan)
        while len(self._plans) > _KEEP:
            self._plans.popitem(last=False)
        return plan


PREP_MAX_ROWS = 1 << 20
"""Largest prepared table per side; larger peer pairs use the plain coalesced path."""
PREP_BUDGET_ROWS = 1 << 21
"""Rows prepared over all peer pairs together; the least recently used pairs are released
beyond it. A row costs about 140 bytes (tables and NIXL's two lists): about 290 MiB at most
(measured: scripts/bench_prepped.py)."""


class Memory(NamedTuple):
    """Where one side's regions live, as NIXL names it (every region of a manifest shares it:
    ``validate_manifest``); a READ's descriptor lists carry it, or NIXL finds no registration
    covering VRAM posted as DRAM."""

    mem: str
    """NIXL memory type: DRAM or VRAM."""
    device_id: int
    """GPU index (0 for DRAM)."""


DRAM = Memory("DRAM", 0)


def memory_of(manifest: Manifest) -> Memory:
    """The memory of ``manifest``'s regions."""
    region = manifest.regions[0]
    return Memory(region.mem, region.device_id)


Tables = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``((local addrs, lens), (remote addrs, lens))``: a READ's descriptor tables."""


@dataclass(frozen=True, eq=False)
class StagedRead:
    """A READ's staged form: ``plan``'s runs, read from ``remote`` (their addresses at the
    peer) into a staging lease, then scattered into place; ``direct`` builds the READ's
    descriptor tables, for a pull that finds no staging room (most never need them)."""

    plan: descriptors.StagedPlan
    remote: np.ndarray
    direct: Callable[[], Tables]


@dataclass(frozen=True, eq=False)
class PeerRead:
    """What one prefill rank's READ moves, and how it is posted: by index into the peer's
    prepared lists (``prepped``), or as coalesced descriptor tables (``tables``)."""

    kv_bytes: int
    state_bytes: int
    num_descriptors: int
    tables: Tables | None = None
    """``((local addrs, lens), (remote addrs, lens))`` of the plain path (None with a staged
    form: built by it when needed)."""
    prepped: tuple[Any, np.ndarray, Any, np.ndarray] | None = None
    """``(local list, local indices, remote list, remote indices)`` of the prepped path."""
    memory: tuple[Memory, Memory] = (DRAM, DRAM)
    """``(local, remote)`` memory of the plain path's tables (prepped lists carry their own)."""
    staged: StagedRead | None = None
    """The tables' staged form, posted instead of them when a staging lease is free."""

    @property
    def total_bytes(self) -> int:
        """Bytes this READ moves."""
        return self.kv_bytes + self.state_bytes

    def post(
        self, transport: Transport, remote: str, notif: bytes, stage_at: int | None = None
    ) -> Callable[[], PostedRead]:
        """The call that posts this READ from agent ``remote`` (run by ``Reads``); with
        ``stage_at`` (a staging lease's address), its staged form's runs into the lease."""
        if stage_at is not None:
            assert self.staged is not None
            plan, (_, (rmem, rdev)) = self.staged.plan, self.memory
            local = (plan.run_at + stage_at, plan.run_length)
            return functools.partial(transport.read, remote, local,
                                     (self.staged.remote, plan.run_length), notif,
                                     remote_mem=rmem, remote_device_id=rdev)  # fmt: skip
        if self.prepped is not None:
            return functools.partial(transport.read_prepped, *self.prepped, notif)
        tables = self.tables if self.tables is not None or self.staged is None else (
            self.staged.direct())  # fmt: skip
        assert tables is not None
        (mem, dev), (remote_mem, remote_dev) = self.memory
        return functools.partial(transport.read, remote, *tables, notif, mem=mem,
                                 device_id=dev, remote_mem=remote_mem,
                                 remote_device_id=remote_dev)  # fmt: skip


def table_read(
    plan: descriptors.ReadPlan, local_bases: Sequence[int], peer: Peer, local: Memory
) -> PeerRead:
    """``plan`` as coalesced descriptor tables at the two sides' region bases (``local``: our
    regions' memory; the peer's comes from its manifest)."""
    if plan.num_descriptors == 0:
        return PeerRead(0, 0, 0)
    lb = np.asarray(local_bases, dtype=np.int64)
    rb = np.asarray(peer.region_bases, dtype=np.int64)
    local_addr = lb[plan.local_region] + plan.local_offset
    remote_addr = rb[plan.remote_region] + plan.remote_offset
    return PeerRead(
        plan.kv_bytes,
        plan.state_bytes,
        plan.num_descriptors,
        tables=((local_addr, plan.length), (remote_addr, plan.length)),
        memory=(local, memory_of(peer.manifest)),
    )


def joined(reads: Sequence[PeerRead]) -> PeerRead:
    """Table READs from one agent (a pod sidecar's ranks) as one READ."""
    parts = [r for r in reads if r.num_descriptors]
    if len(parts) <= 1:
        return parts[0] if parts else PeerRead(0, 0, 0)
    assert all(r.tables is not None and r.memory == parts[0].memory for r in parts)
    cols = [np.concatenate([r.tables[side][i] for r in parts])  # type: ignore[index]
            for side in (0, 1) for i in (0, 1)]  # fmt: skip
    return PeerRead(
        sum(int(r.kv_bytes) for r in parts),
        sum(int(r.state_bytes) for r in parts),
        sum(int(r.num_descriptors) for r in parts),
        tables=((cols[0], cols[1]), (cols[2], cols[3])),
        memory=parts[0].memory,
    )


@dataclass(eq=False)
class _Prepared:
    local: Manifest
    tables: descriptors.PreppedGeometry | None = None
    lists: tuple[Any, Any] | None = None
    pending: bool = True  # still being prepared on the views' thread

    @property
    def rows(self) -> int:
        return 0 if self.tables is None or self.lists is None else self.tables.num_rows


class PeerViews:
    """Per peer epoch and registration: the prepared local and remote descriptor lists (the
    FA and Mamba views of the peer pair, once), and each pull's choice of path.

    A request whose blocks do not line up in runs is posted by index into the prepared lists
    (no table built); one whose rows coalesce is posted as the coalesced tables of those rows,
    because fewer descriptors beat prepared ones on the wire (measured: docs/benchmarks.md).
    So a prepped pull never posts more descriptors than the coalesced plan.
    Re-blocking peers and pairs above PREP_MAX_ROWS rows always use the coalesced tables.

    The lists of a new peer pair are prepared on one background thread (a million rows take a
    quarter of a second), so the event loop never waits for them: pulls go by coalesced tables
    until they are ready. Prepared rows are bounded by PREP_BUDGET_ROWS over all pairs.

    Off by default (``--prepped-reads`` turns it on).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        enabled: bool = False,
        keep: int = _KEEP,
        budget_rows: int = PREP_BUDGET_ROWS,
    ) -> None:
        self._transport = transport
        self.enabled = enabled
        """Whether lists are prepared at all (``--prepped-reads``); off: always tables."""
        self._keep = keep
        self._budget_rows = budget_rows
        self._prepared: OrderedDict[tuple, _Prepared] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards _closed against the preparing thread
        self._closing = False
        self._jobs: set[Future] = set()  # preparations not yet recorded on the loop
        self.prepped_reads = 0
        """READs posted by index (the rest were posted as coalesced tables)."""

    def plan(
        self,
        peer: Peer,
        local: Manifest,
        local_bases: Sequence[int],
        geometry: descriptors.ReadGeometry,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        num_tokens: int = -1,
        remote_tokens: int = 0,
        *,
        local_checked: bool = False,
    ) -> PeerRead:
        """One rank's READ of a pull (BlockIdError names a bad field, as ``plan_pull``;
        ``local_checked`` as there)."""
        prepared = self._get(peer, local, local_bases, geometry) if self.enabled else None
        if prepared is not None and prepared.tables is not None and prepared.lists is not None:
            idx = prepared.tables.plan(local_ids, remote_ids)
            if idx.num_descriptors == 0:
                return PeerRead(0, 0, 0)
            merged = prepared.tables.cheaper(idx)
            if merged is None:  # coalescing merges nothing: post by index
                loc, rem = prepared.lists
                self.prepped_reads += 1
                return PeerRead(
                    idx.kv_bytes,
                    idx.state_bytes,
                    idx.num_descriptors,
                    prepped=(loc, idx.local_idx, rem, idx.remote_idx),
                )
            return table_read(merged, local_bases, peer, memory_of(local))
        plan = descriptors.plan_pull(geometry, local_ids, remote_ids, num_tokens, remote_tokens,
                                     local_checked=local_checked)  # fmt: skip
        return table_read(plan, local_bases, peer, memory_of(local))

    def _get(
        self,
        peer: Peer,
        local: Manifest,
        local_bases: Sequence[int],
        geometry: descriptors.ReadGeometry,
    ) -> _Prepared | None:
        """The pair's prepared lists when ready; else None, starting their preparation."""
        key = (peer.address, peer.engine_id, peer.epoch, peer.generation, peer.agent_name,
               id(local))  # fmt: skip
        hit = self._prepared.get(key)
        if hit is not None and hit.local is local:
            if hit.pending:
                return None
            if hit.lists is None or not any(x.released for x in hit.lists):
                self._prepared.move_to_end(key)
                return hit
            self._release(hit)  # the peer's agent was re-added: its lists went stale
        entry = _Prepared(local)
        self._prepared[key] = entry
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvxferd-prep")
        job = self._executor.submit(
            self._prepare, geometry, list(local_bases), list(peer.region_bases),
            peer.agent_name, peer.address, (memory_of(local), memory_of(peer.manifest)),
        )  # fmt: skip
        self._jobs.add(job)
        loop = asyncio.get_running_loop()
        job.add_done_callback(
            lambda job: loop.call_soon_threadsafe(self._prepared_done, key, entry, job)
        )
        self._evict()
        return None

    def _prepare(
        self,
        geometry: descriptors.ReadGeometry,
        local_bases: list[int],
        remote_bases: list[int],
        agent: str,
        address: str,
        memory: tuple[Memory, Memory],
    ) -> tuple[descriptors.PreppedGeometry | None, tuple[Any, Any] | None]:
        """Build a pair's tables and prepare its lists (on the views' thread)."""
        tables = descriptors.prepped_geometry(geometry, PREP_MAX_ROWS)
        if tables is None or self._closing:
            return tables, None
        (la, ll), (ra, rl) = tables.addresses(local_bases, remote_bases)
        (mem, dev), (remote_mem, remote_dev) = memory
        try:
            loc = self._transport.prep_local((la, ll), mem=mem, device_id=dev)
            try:
                rem = self._transport.prep_remote(agent, (ra, rl), mem=remote_mem,
                                                  device_id=remote_dev)  # fmt: skip
            except KvxferdError:
                loc.release()
                raise
        except KvxferdError as exc:
            log.warning("no prepared lists for %s (coalesced tables instead): %s", address, exc)
            return tables, None
        with self._lock:
            if not self._closing:
                return tables, (loc, rem)
        for item in (loc, rem):  # close() runs: the registration is going away
            item.release()
        return tables, None

    def _prepared_done(self, key: tuple, entry: _Prepared, job: Future) -> None:
        """On the loop: record a finished preparation (or drop it when no longer wanted)."""
        self._jobs.discard(job)
        entry.pending = False
        if job.cancelled():
            return
        exc = job.exception()
        if exc is not None:
            log.error("preparing lists for a peer failed", exc_info=exc)
            return
        entry.tables, entry.lists = job.result()
        if self._prepared.get(key) is not entry:  # evicted, replaced or closed meanwhile
            self._release(entry)
            return
        self._evict()

    def _evict(self) -> None:
        """Release the least recently used pairs beyond ``keep`` pairs or the row budget."""
        rows = sum(e.rows for e in self._prepared.values())
        while len(self._prepared) > self._keep or (
            rows > self._budget_rows and len(self._prepared) > 1
        ):
            old = self._prepared.popitem(last=False)[1]
            rows -= old.rows
            self._release(old)

    @staticmethod
    def _release(entry: _Prepared) -> None:
        lists, entry.lists = entry.lists, None
        _release_lists(lists)

    def close(self) -> None:
        """Release every prepared list (before the registration goes away); waits for a
        preparation in progress, whose lists are then released too. The views can be used
        again afterwards (a new registration)."""
        with self._lock:
            self._closing = True
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for job in self._jobs:  # finished, but not yet recorded on the loop
            if job.done() and not job.cancelled() and job.exception() is None:
                _release_lists(job.result()[1])
        self._jobs.clear()
        for entry in self._prepared.values():
            self._release(entry)
        self._prepared.clear()
        with self._lock:
            self._closing = False


def _release_lists(lists: tuple[Any, Any] | None) -> None:
    for item in lists or ():
        try:
            item.release()
        except KvxferdError as exc:
            log.warning("could not release %r: %s", item, exc)
