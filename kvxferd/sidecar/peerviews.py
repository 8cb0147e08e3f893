"""What a pull needs that does not depend on the request, computed once per peer epoch.

Rank ownership (which prefill ranks this decode rank reads from, and which no decode rank reads)
depends only on the local registration and the prefill's TP size; the prepared descriptor lists
of a peer pair (the seed-004 views, :mod:`kvxferd.descriptors.prepped`) on the registration and
the peer's epoch. Both are keyed by the registered manifest's identity, so a re-registration
starts afresh.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True, eq=False)
class PeerRead:
    """What one prefill rank's READ moves, and how it is posted: by index into the peer's
    prepared lists (``prepped``), or as coalesced descriptor tables (``tables``)."""

    kv_bytes: int
    state_bytes: int
    num_descriptors: int
    tables: tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None
    """``((local addrs, lens), (remote addrs, lens))`` of the plain path."""
    prepped: tuple[Any, np.ndarray, Any, np.ndarray] | None = None
    """``(local list, local indices, remote list, remote indices)`` of the prepped path."""

    @property
    def total_bytes(self) -> int:
        """Bytes this READ moves."""
        return self.kv_bytes + self.state_bytes

    def post(self, transport: Transport, remote: str, notif: bytes) -> Callable[[], PostedRead]:
        """The call that posts this READ from agent ``remote`` (run by ``Reads``)."""
        if self.prepped is not None:
            return functools.partial(transport.read_prepped, *self.prepped, notif)
        assert self.tables is not None
        return functools.partial(transport.read, remote, *self.tables, notif)


@dataclass(eq=False)
class _Prepared:
    local: Manifest
    tables: descriptors.PreppedGeometry | None
    lists: tuple[Any, Any] | None = None


class PeerViews:
    """Per peer epoch and registration: the prepared local and remote descriptor lists (the
    FA and Mamba views of the peer pair, once), and each pull's choice of path.

    A request whose blocks do not line up in runs is posted by index into the prepared lists
    (no table built, no coalescing); one whose runs coalesce is posted as coalesced tables,
    because fewer descriptors beat prepared ones on the wire (measured: docs/benchmarks.md).
    Re-blocking peers and pairs above PREP_MAX_ROWS rows always use the coalesced tables.

    Off by default (``--prepped-reads`` turns it on) until the fault campaign has run with it.
    """

    def __init__(self, transport: Transport, *, enabled: bool = False, keep: int = _KEEP) -> None:
        self._transport = transport
        self.enabled = enabled
        """Whether lists are prepared at all (``--prepped-reads``); off: always tables."""
        self._keep = keep
        self._prepared: OrderedDict[tuple, _Prepared] = OrderedDict()
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
    ) -> PeerRead:
        """One rank's READ of a pull (BlockIdError names a bad field, as ``plan_pull``)."""
        prepared = self._get(peer, local, local_bases, geometry) if self.enabled else None
        if prepared is not None and prepared.tables is not None and prepared.lists is not None:
            idx = prepared.tables.plan(local_ids, remote_ids)
            if idx.num_descriptors == 0:
                return PeerRead(0, 0, 0)
            if idx.num_descriptors <= idx.runs:  # coalescing would merge nothing
                loc, rem = prepared.lists
                self.prepped_reads += 1
                return PeerRead(
                    idx.kv_bytes,
                    idx.state_bytes,
                    idx.num_descriptors,
                    prepped=(loc, idx.local_idx, rem, idx.remote_idx),
                )
        plan = descriptors.plan_pull(geometry, local_ids, remote_ids, num_tokens, remote_tokens)
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
        )

    def _get(
        self,
        peer: Peer,
        local: Manifest,
        local_bases: Sequence[int],
        geometry: descriptors.ReadGeometry,
    ) -> _Prepared | None:
        key = (peer.address, peer.engine_id, peer.epoch, peer.agent_name, id(local))
        hit = self._prepared.get(key)
        if hit is not None and hit.local is local:
            if hit.lists is None or not any(x.released for x in hit.lists):
                self._prepared.move_to_end(key)
                return hit
            self._release(hit)  # the peer's agent was re-added: its lists went stale
        tables = descriptors.prepped_geometry(geometry, PREP_MAX_ROWS)
        entry = _Prepared(local, tables)
        if tables is not None:
            (la, ll), (ra, rl) = tables.addresses(local_bases, peer.region_bases)
            try:
                loc = self._transport.prep_local((la, ll))
                try:
                    rem = self._transport.prep_remote(peer.agent_name, (ra, rl))
                except KvxferdError:
                    loc.release()
                    raise
                entry.lists = (loc, rem)
            except KvxferdError as exc:
                log.warning("no prepared lists for %s (coalesced tables instead): %s",
                            peer.address, exc)  # fmt: skip
        self._prepared[key] = entry
        while len(self._prepared) > self._keep:
            self._release(self._prepared.popitem(last=False)[1])
        return entry

    @staticmethod
    def _release(entry: _Prepared) -> None:
        lists, entry.lists = entry.lists, None
        for item in lists or ():
            try:
                item.release()
            except KvxferdError as exc:
                log.warning("could not release %r: %s", item, exc)

    def close(self) -> None:
        """Release every prepared list (before the registration goes away)."""
        for entry in self._prepared.values():
            self._release(entry)
        self._prepared.clear()
