"""The READs of one pull, planned from what is cached per peer epoch.

A pull reads from each prefill rank its tickets name (one READ per rank's sidecar), or, from a
pod sidecar that serves every rank, one READ: every rank's descriptor tables joined, since one
agent owns all of their memory. Read geometries are cached per peer epoch, registration and
rank; the stacked (fan-in) geometry of ranks read together per set of geometries. A table READ
of at least ``staging_min_descriptors`` rows into DRAM also gets its staged form (whole runs into
a staging buffer, then scattered: kvxferd.descriptors.staging), posted when a staging lease is
free and the form pays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvxferd import descriptors
from kvxferd.descriptors.fanin import FanInGeometry, fan_in_geometry
from kvxferd.descriptors.staging import stage_plans
from kvxferd.errors import HandshakeError
from kvxferd.sidecar.peerviews import (
    PeerRead,
    PeerViews,
    RankPlans,
    StagedRead,
    Tables,
    joined,
    memory_of,
    table_read,
)
from kvxferd.wire import Manifest, PullRequest, Ticket

if TYPE_CHECKING:
    from kvxferd.sidecar.peers import Peer
    from kvxferd.sidecar.peerviews import Memory
    from kvxferd.transport.base import Transport

_KEEP_GEOMETRIES = 256  # per-peer read geometries cached (keyed by peer epoch)
_KEEP_FAN_INS = 64  # stacked geometries of the prefill ranks pulls read from together


class ReadPlanner:
    """Plans a pull's READs: per rank, or one for a pod (``prepped_reads``: post by index into
    per-peer prepared lists where that moves fewer descriptors; never for a pod)."""

    def __init__(
        self, transport: Transport, *, prepped_reads: bool = False,
        staging_min_descriptors: int = 0, staging_max_bytes: int = 0,
    ) -> None:  # fmt: skip
        self._geometries: OrderedDict[
            tuple[str, str, int, int, int, int], tuple[Manifest, descriptors.ReadGeometry]
        ] = OrderedDict()
        self._fan_ins: OrderedDict[
            tuple[int, ...], tuple[tuple[descriptors.ReadGeometry, ...], FanInGeometry | None]
        ] = OrderedDict()
        self.rank_plans = RankPlans()
        self.views = PeerViews(transport, enabled=prepped_reads)
        self._stage_min = staging_min_descriptors
        self._stage_max = staging_max_bytes  # 0: never staged

    def close(self) -> None:
        """Release the prepared lists."""
        self.views.close()

    def pod(
        self, req: PullRequest, peer: Peer, sources: Sequence[int], local: Manifest,
        bases: Sequence[int], *, local_checked: bool = False,
    ) -> PeerRead:  # fmt: skip
        """The one READ of the ranks of a pod sidecar that this rank reads from (``sources``):
        every rank's plan as descriptor tables, joined (HandshakeError if the peer serves
        another number of ranks than the ticket spans)."""
        ticket = req.tickets[0]
        if peer.ranks != ticket.ranks:
            raise HandshakeError(f"peer {peer.address} serves {peer.ranks} ranks, the ticket "
                                 f"spans {ticket.ranks}")  # fmt: skip
        views = [peer.rank(r) for r in sources]
        plans = self._plans(req, views, [ticket] * len(views), local, local_checked)
        return self._read(plans, views, bases, memory_of(local))

    def _read(
        self, plans: Sequence[descriptors.ReadPlan], peers: Sequence[Peer], bases: Sequence[int],
        memory: Memory,
    ) -> PeerRead:  # fmt: skip
        """One READ of ``plans`` (one per peer, all from one agent): descriptor tables, or its
        staged form where that pays (kvxferd.descriptors.staging: a DRAM destination and at
        least ``staging_min_descriptors`` rows), the tables then built only if needed."""

        def direct() -> PeerRead:
            return joined([table_read(p, bases, v, memory)
                           for p, v in zip(plans, peers, strict=True)])  # fmt: skip

        rows = sum(p.num_descriptors for p in plans)
        if not self._stage_max or memory.mem != "DRAM" or rows < self._stage_min:
            return direct()
        counts = [len(p.region_bases) for p in peers]
        staged = stage_plans(plans, counts, min_descriptors=self._stage_min,
                             max_bytes=self._stage_max)  # fmt: skip
        if staged is None:
            return direct()
        rbases = np.concatenate([np.asarray(p.region_bases, dtype=np.int64) for p in peers])
        remote = rbases[staged.run_key] + staged.run_offset

        def tables() -> Tables:
            read = direct()
            assert read.tables is not None
            return read.tables

        return PeerRead(
            sum(p.kv_bytes for p in plans), sum(p.state_bytes for p in plans), rows,
            memory=(memory, memory_of(peers[0].manifest)),
            staged=StagedRead(staged, remote, tables),
        )  # fmt: skip

    def ranks(
        self, req: PullRequest, peers: list[Peer], tickets: list[Ticket], local: Manifest,
        bases: Sequence[int], *, local_checked: bool = False, tables: bool = False,
    ) -> list[PeerRead]:  # fmt: skip
        """Every source rank's READ; one stacked plan for all ranks where they read the same
        remote ids and share a geometry (kvxferd.descriptors.fanin), else one plan per rank.
        ``tables``: every READ as descriptor tables (never by index into prepared lists);
        ``local_checked``: the pull's local ids were checked against ``local`` already."""
        memory = memory_of(local)
        if tables or not self.views.enabled:
            plans = self._plans(req, peers, tickets, local, local_checked)
            return [self._read([p], [peer], bases, memory)
                    for p, peer in zip(plans, peers, strict=True)]  # fmt: skip
        geometries = tuple(self._geometry(local, p) for p in peers)
        return [
            self.views.plan(
                peer,
                local,
                bases,
                geometry,
                req.block_ids,
                ticket.block_ids,
                req.num_tokens,
                ticket.num_tokens,
                local_checked=local_checked,
            )
            for peer, ticket, geometry in zip(peers, tickets, geometries, strict=True)
        ]

    def _plans(
        self, req: PullRequest, peers: Sequence[Peer], tickets: Sequence[Ticket],
        local: Manifest, local_checked: bool,
    ) -> list[descriptors.ReadPlan]:  # fmt: skip
        """Every source rank's coalesced plan: stacked where the ranks read the same remote ids
        and share a geometry (kvxferd.descriptors.fanin), else rank by rank."""
        geometries = tuple(self._geometry(local, p) for p in peers)
        if len(peers) > 1:
            ids = tickets[0].block_ids
            fan = self._fan_in(geometries) if all(t.block_ids == ids for t in tickets) else None
            if fan is not None:
                return list(fan.plan(req.block_ids, ids, local_checked=local_checked))
        return [
            descriptors.plan_pull(geometry, req.block_ids, ticket.block_ids, req.num_tokens,
                                  ticket.num_tokens, local_checked=local_checked)
            for ticket, geometry in zip(tickets, geometries, strict=True)
        ]  # fmt: skip

    def _geometry(self, local: Manifest, peer: Peer) -> descriptors.ReadGeometry:
        """Per-peer read geometry (checks and per-layer work done once per peer epoch, rank and
        registration, and local registration)."""
        key = (peer.address, peer.engine_id, peer.epoch, peer.generation, peer.manifest.tp_rank,
               id(local))  # fmt: skip
        cached = self._geometries.get(key)
        if cached is not None and cached[0] is local:
            self._geometries.move_to_end(key)
            return cached[1]
        geometry = descriptors.read_geometry(local, peer.manifest)
        self._geometries[key] = (local, geometry)
        while len(self._geometries) > _KEEP_GEOMETRIES:
            self._geometries.popitem(last=False)
        return geometry

    def _fan_in(self, geometries: tuple[descriptors.ReadGeometry, ...]) -> FanInGeometry | None:
        """The stacked geometry of these ranks (built once per set of peer epochs)."""
        key = tuple(id(g) for g in geometries)
        cached = self._fan_ins.get(key)
        if cached is not None and all(a is b for a, b in zip(cached[0], geometries, strict=True)):
            self._fan_ins.move_to_end(key)
            return cached[1]
        fan = fan_in_geometry(geometries)
        self._fan_ins[key] = (geometries, fan)
        while len(self._fan_ins) > _KEEP_FAN_INS:
            self._fan_ins.popitem(last=False)
        return fan


__all__ = ["ReadPlanner"]
