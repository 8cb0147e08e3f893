"""The READs of one pull, planned from what is cached per peer epoch.

A pull reads from each prefill rank its tickets name (one READ per rank's sidecar), or, from a
pod sidecar that serves every rank, one READ: every rank's descriptor tables joined, since one
agent owns all of their memory. Read geometries are cached per peer epoch, registration and
rank; the stacked (fan-in) geometry of ranks read together per set of geometries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvxferd import descriptors
from kvxferd.descriptors.fanin import FanInGeometry, fan_in_geometry
from kvxferd.errors import HandshakeError
from kvxferd.sidecar.peerviews import PeerRead, PeerViews, RankPlans, joined, memory_of, table_read
from kvxferd.wire import Manifest, PullRequest, Ticket

if TYPE_CHECKING:
    from kvxferd.sidecar.peers import Peer
    from kvxferd.transport.base import Transport

_KEEP_GEOMETRIES = 256  # per-peer read geometries cached (keyed by peer epoch)
_KEEP_FAN_INS = 64  # stacked geometries of the prefill ranks pulls read from together


class ReadPlanner:
    """Plans a pull's READs: per rank, or one for a pod (``prepped_reads``: post by index into
    per-peer prepared lists where that moves fewer descriptors; never for a pod)."""

    def __init__(self, transport: Transport, *, prepped_reads: bool = False) -> None:
        self._geometries: OrderedDict[
            tuple[str, str, int, int, int, int], tuple[Manifest, descriptors.ReadGeometry]
        ] = OrderedDict()
        self._fan_ins: OrderedDict[
            tuple[int, ...], tuple[tuple[descriptors.ReadGeometry, ...], FanInGeometry | None]
        ] = OrderedDict()
        self.rank_plans = RankPlans()
        self.views = PeerViews(transport, enabled=prepped_reads)

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
        return joined(self.ranks(req, views, [ticket] * len(views), local, bases,
                                 local_checked=local_checked, tables=True))  # fmt: skip

    def ranks(
        self, req: PullRequest, peers: list[Peer], tickets: list[Ticket], local: Manifest,
        bases: Sequence[int], *, local_checked: bool = False, tables: bool = False,
    ) -> list[PeerRead]:  # fmt: skip
        """Every source rank's READ; one stacked plan for all ranks where they read the same
        remote ids and share a geometry (kvxferd.descriptors.fanin), else one plan per rank.
        ``tables``: every READ as descriptor tables (never by index into prepared lists);
        ``local_checked``: the pull's local ids were checked against ``local`` already."""
        geometries = tuple(self._geometry(local, p) for p in peers)
        memory = memory_of(local)
        if len(peers) > 1 and (tables or not self.views.enabled):
            ids = tickets[0].block_ids
            fan = self._fan_in(geometries) if all(t.block_ids == ids for t in tickets) else None
            if fan is not None:
                plans = fan.plan(req.block_ids, ids, local_checked=local_checked)
                return [table_read(p, bases, peer, memory)
                        for p, peer in zip(plans, peers, strict=True)]  # fmt: skip
        if tables:
            return [
                table_read(descriptors.plan_pull(geometry, req.block_ids, ticket.block_ids,
                                                 req.num_tokens, ticket.num_tokens,
                                                 local_checked=local_checked), bases, peer, memory)
                for peer, ticket, geometry in zip(peers, tickets, geometries, strict=True)
            ]  # fmt: skip
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
