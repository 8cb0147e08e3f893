"""Pulls on the decode side: handshake, claim, plan, one NIXL READ per prefill rank, notify.

A pull moves forward through PullState and ends DONE only when every READ of every source rank
completed; anything else ends FAILED with a reason code, never DONE (fail closed), and only
once none of its READs can still write (kvxferd.sidecar.reads). A READ never outlives the
claim it reads under: its wait ends at the earlier of the pull's deadline and the claim's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
import numpy as np
from msgspec import structs

from kvxferd import descriptors
from kvxferd.errors import (
    AuthError,
    BlockIdError,
    ClaimTimeoutError,
    HandshakeError,
    HoldExpiredError,
    IncompatiblePeerError,
    KvxferdError,
    PeerDisconnectedError,
    PullError,
    TransferTimeoutError,
    UnknownHoldError,
    UnknownPullError,
)
from kvxferd.sidecar.finished import FinishedFeed
from kvxferd.sidecar.reads import ABORT_S, SETTLE_S, Reads
from kvxferd.sidecar.states import PullState, advance
from kvxferd.wire import (
    ClaimRequest,
    FinishedPull,
    FinishedPulls,
    Manifest,
    PullRequest,
    PullStatus,
    Ticket,
)

if TYPE_CHECKING:
    from kvxferd.sidecar.peers import Peer
    from kvxferd.sidecar.service import Sidecar

log = logging.getLogger(__name__)

_KEEP_FINISHED = 4096  # finished pulls remembered for status queries
_KEEP_GEOMETRIES = 256  # per-peer read geometries cached (keyed by peer epoch)

# Exception type -> failure reason code (checked in order; subclasses first).
_REASONS: list[tuple[type[BaseException], str]] = [
    (HoldExpiredError, "hold_expired"),
    (UnknownHoldError, "unknown_hold"),
    (AuthError, "auth"),
    (IncompatiblePeerError, "incompatible"),
    (ClaimTimeoutError, "claim_timeout"),
    (HandshakeError, "handshake"),
    (PeerDisconnectedError, "peer_disconnected"),
    (TransferTimeoutError, "deadline"),
    (TimeoutError, "deadline"),
    (BlockIdError, "block_ids"),
    (PullError, "pull"),
    (KvxferdError, "transfer"),
]


@dataclass
class Pull:
    """One pull's record; ``done`` is set when it reaches DONE or FAILED."""

    pull_id: str
    request: PullRequest
    started: float = field(default_factory=time.monotonic)
    state: PullState = PullState.PENDING
    reason: str = ""
    detail: str = ""
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    duration_s: float = 0.0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def advance(self, new: PullState) -> None:
        """Move forward through ``states.advance``; a live state another rank of this pull
        already passed is no move (ranks progress concurrently). Out of DONE/FAILED raises."""
        if not self.state.terminal and not new.terminal and new <= self.state:
            return
        self.state = advance(self.state, new)

    def fail(self, reason: str, detail: str) -> None:
        """End FAILED with a reason code (StateError if it had already ended)."""
        self.advance(PullState.FAILED)
        self.reason, self.detail = reason, detail

    def finished(self) -> FinishedPull:
        """The finished-feed entry of an ended pull: its local ids are invalid unless DONE."""
        done = self.state is PullState.DONE
        return FinishedPull(
            pull_id=self.pull_id,
            request_id=self.request.request_id,
            state="done" if done else "failed",
            reason=self.reason,
            failed_block_ids=[]
            if done
            else [[b for b in g if b >= 0] for g in self.request.block_ids],  # fmt: skip
        )

    def status(self) -> PullStatus:
        """The wire view."""
        return PullStatus(
            pull_id=self.pull_id,
            state=self.state.wire_name,
            reason=self.reason,
            detail=self.detail,
            kv_bytes=self.kv_bytes,
            state_bytes=self.state_bytes,
            descriptors=self.descriptors,
            duration_s=self.duration_s,
        )


class PullRunner:
    """Starts pulls as tasks and remembers their outcome (bounded)."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar
        self._pulls: OrderedDict[str, Pull] = OrderedDict()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._geometries: OrderedDict[tuple[str, str, int], descriptors.ReadGeometry] = (
            OrderedDict()
        )
        self.reads = Reads(sidecar.agent, on_stuck=sidecar.peers.forget)
        self.feed = FinishedFeed()

    def _geometry(self, peer: Peer) -> descriptors.ReadGeometry:
        """Per-peer read geometry (checks and per-layer work done once per peer epoch)."""
        key = (peer.address, peer.engine_id, peer.epoch)
        geometry = self._geometries.get(key)
        if geometry is None:
            local = self._sidecar.manifest
            assert local is not None
            geometry = descriptors.read_geometry(local, peer.manifest)
            self._geometries[key] = geometry
            while len(self._geometries) > _KEEP_GEOMETRIES:
                self._geometries.popitem(last=False)
        else:
            self._geometries.move_to_end(key)
        return geometry

    def start(self, req: PullRequest) -> Pull:
        """Validate ``req`` synchronously (4xx to the engine), then run it in the background."""
        _validate(req, self._sidecar)
        pull = Pull(pull_id=secrets.token_hex(8), request=req)
        self._pulls[pull.pull_id] = pull
        while len(self._pulls) > _KEEP_FINISHED:
            oldest = next(iter(self._pulls.values()))
            if not oldest.done.is_set():
                break
            self._pulls.popitem(last=False)
        self._sidecar.metrics.pulls_in_flight.inc()
        task = asyncio.create_task(self._run(pull), name=f"pull-{pull.pull_id}")
        self._running[pull.pull_id] = task
        task.add_done_callback(lambda _: self._running.pop(pull.pull_id, None))
        return pull

    async def status(self, pull_id: str, wait_s: float) -> PullStatus:
        """Status of a pull, long-polling up to ``wait_s`` for it to finish."""
        pull = self._pulls.get(pull_id)
        if pull is None:
            raise UnknownPullError(f"no pull {pull_id!r} on this sidecar")
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pull.done.wait(), wait_s)
        return pull.status()

    def cancel(self, pull_id: str) -> Pull:
        """Cancel a running pull: it ends FAILED (``cancelled``) once its READs settled."""
        pull = self._pulls.get(pull_id)
        if pull is None:
            raise UnknownPullError(f"no pull {pull_id!r} on this sidecar")
        task = self._running.get(pull_id)
        if task is not None:
            task.cancel()
        return pull

    async def run(self, req: PullRequest) -> PullStatus:
        """Start a pull and answer its final status (one engine call per pull).

        Bounded: a pull ends by its deadline plus the time its READs take to settle.
        """
        pull = self.start(req)
        bound = req.deadline_s + SETTLE_S + ABORT_S + 5.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pull.done.wait()), bound)
        return pull.status()

    def finished_since(self, cursor: int, limit: int) -> FinishedPulls:
        """The finished-pulls feed from ``cursor`` (one page)."""
        return self.feed.since(cursor, limit)

    async def close(self) -> None:
        """Cancel running pulls (they end FAILED once their READs settled)."""
        for task in list(self._running.values()):
            task.cancel()
        for task in list(self._running.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.reads.close()

    async def _run(self, pull: Pull) -> None:
        sc = self._sidecar
        req = pull.request
        deadline = time.monotonic() + req.deadline_s
        try:
            async with asyncio.timeout(req.deadline_s):
                local = sc.manifest
                assert local is not None
                ranks = descriptors.source_ranks(local, len(req.tickets))
                # A TaskGroup, not gather: one failed read cancels its siblings, so no READ is
                # still running (and no handle still live) once the pull reports FAILED.
                async with asyncio.TaskGroup() as group:
                    for r in ranks:
                        group.create_task(self._read_from(pull, req.tickets[r], deadline))
                    for r in unread_ranks(local, len(req.tickets)):
                        group.create_task(self._release_unread(req.tickets[r]))
            pull.advance(PullState.DONE)
            sc.metrics.pulls.labels("done").inc()
        except asyncio.CancelledError:
            # The TaskGroup has waited for every rank's READs to settle before this runs.
            self._fail(pull, "cancelled", "pull cancelled (by the engine or at shutdown)")
            raise
        except BaseException as exc:  # every failure path ends FAILED with a reason
            while isinstance(exc, BaseExceptionGroup):  # the TaskGroup's; its first cause
                exc = exc.exceptions[0]
            reason = next((r for t, r in _REASONS if isinstance(exc, t)), "internal")
            self._fail(pull, reason, str(exc) or type(exc).__name__)
            if reason != "internal":
                log.warning("pull %s failed: %s: %s", pull.pull_id, reason, exc)
            else:
                log.exception("pull %s failed unexpectedly", pull.pull_id)
        finally:
            pull.duration_s = time.monotonic() - pull.started
            sc.metrics.phase_duration.labels("total").observe(pull.duration_s)
            sc.metrics.pulls_in_flight.dec()
            self.feed.add(pull.finished())
            pull.done.set()

    def _fail(self, pull: Pull, reason: str, detail: str) -> None:
        pull.fail(reason, detail)
        self._sidecar.metrics.pulls.labels("failed").inc()
        self._sidecar.metrics.pull_failures.labels(reason).inc()

    async def _read_from(self, pull: Pull, ticket: Ticket, deadline: float) -> None:
        """Handshake with, claim at, and read from one prefill rank."""
        sc = self._sidecar
        local = sc.manifest
        assert local is not None
        m = sc.metrics
        pull.advance(PullState.HANDSHAKING)
        t0 = time.monotonic()
        peer = await sc.peers.get(ticket.peer, ticket.engine_id, ticket.epoch)
        m.phase_duration.labels("handshake").observe(time.monotonic() - t0)

        pull.advance(PullState.CLAIMING)
        t0 = time.monotonic()
        request = ClaimRequest(
            ticket=ticket,
            reader=sc.agent.name,
            reader_tp_size=local.tp_size,
            claim_s=max(0.001, deadline - time.monotonic()),
        )
        try:
            claim = await sc.peers.claim(ticket.peer, request)
        except HandshakeError as exc:
            if isinstance(exc.__cause__, (TimeoutError, httpx.TimeoutException)):
                raise ClaimTimeoutError(f"claim at {ticket.peer} timed out: {exc}") from exc
            raise
        m.phase_duration.labels("claim").observe(time.monotonic() - t0)
        m.lease_headroom.observe(max(0.0, ticket.expires_at - time.time()))
        # The claim's end, on our monotonic clock: the READ must be over by then.
        claim_end = time.monotonic() + (claim.expires_at - time.time())

        local_ids, remote_ids = _pairs(pull.request.block_ids, ticket.block_ids)
        plan = self._geometry(peer).plan(local_ids, remote_ids)
        pull.advance(PullState.TRANSFERRING)
        notif = ticket.hold_id.encode()
        if plan.num_descriptors == 0:
            # Nothing to read from this rank (all blocks skipped): still release its hold.
            sc.agent.send_notif(peer.agent_name, notif)
            return
        await self._transfer(pull, peer, plan, notif, deadline, claim_end)

    async def _release_unread(self, ticket: Ticket) -> None:
        """Notify a prefill rank that no decode rank reads, releasing its hold before expiry.

        Its units are all replicas read from other ranks, so this pull's bytes do not depend on
        it: a failure is logged (the hold then expires), never fatal.
        """
        sc = self._sidecar
        try:
            peer = await sc.peers.get(ticket.peer, ticket.engine_id, ticket.epoch)
            sc.agent.send_notif(peer.agent_name, ticket.hold_id.encode())
        except KvxferdError as exc:
            log.warning(
                "could not release unread hold %s at %s (it will expire): %s",
                ticket.hold_id,
                ticket.peer,
                exc,
            )

    async def _transfer(
        self,
        pull: Pull,
        peer: Peer,
        plan: descriptors.ReadPlan,
        notif: bytes,
        deadline: float,
        claim_end: float,
    ) -> None:
        sc = self._sidecar
        bases = np.asarray(sc.region_bases, dtype=np.int64)
        rbases = np.asarray(peer.region_bases, dtype=np.int64)
        local_addr = bases[plan.local_region] + plan.local_offset
        remote_addr = rbases[plan.remote_region] + plan.remote_offset
        t0 = time.monotonic()
        try:
            transfer = await self.reads.read(
                peer.address,
                peer.agent_name,
                (local_addr, plan.length),
                (remote_addr, plan.length),
                notif,
                nbytes=int(plan.kv_bytes + plan.state_bytes),
                descs=int(plan.num_descriptors),
                deadline=min(deadline, claim_end),
            )
        except PeerDisconnectedError:
            await sc.peers.forget(peer.address)
            raise
        except TransferTimeoutError as exc:
            if claim_end < deadline:
                raise HoldExpiredError(
                    f"the claim at {peer.address} ended before the READ completed: {exc}"
                ) from exc
            raise
        telemetry = transfer.telemetry() or {}
        wire_s = float(telemetry.get("wall_s", time.monotonic() - t0))
        posted = time.monotonic() - wire_s
        m = sc.metrics
        total = int(plan.kv_bytes + plan.state_bytes)
        m.phase_duration.labels("post").observe(posted - t0)
        m.phase_duration.labels("wire").observe(wire_s)
        m.transfer_duration.observe(time.monotonic() - t0)
        m.transfer_descriptors.observe(plan.num_descriptors)
        m.transfer_bytes.labels("kv").inc(plan.kv_bytes)
        m.transfer_bytes.labels("state").inc(plan.state_bytes)
        if wire_s > 0:
            m.transfer_throughput.observe(total / wire_s)
        pull.kv_bytes += int(plan.kv_bytes)
        pull.state_bytes += int(plan.state_bytes)
        pull.descriptors += int(plan.num_descriptors)


def unread_ranks(local: Manifest, remote_tp: int) -> list[int]:
    """Prefill ranks no decode rank reads from (every unit they hold is read from a replica).

    Non-empty only when units are replicated on the prefill side (TP > KV heads). Decode rank 0
    alone answers for them, so each gets exactly one notification; the other ranks return [].
    """
    if local.tp_rank != 0:
        return []
    read: set[int] = set()
    for rank in range(local.tp_size):
        # source_ranks only looks at units_total and tp, so this rank's parts stand in for all.
        read.update(descriptors.source_ranks(structs.replace(local, tp_rank=rank), remote_tp))
    return [r for r in range(remote_tp) if r not in read]


def _pairs(
    local: list[list[int]], remote: list[list[int]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per group, the (local, remote) ids to move: pairs whose local id is -1 are skipped."""
    out_l, out_r = [], []
    for lo, re in zip(local, remote, strict=True):
        lo_a = np.asarray(lo, dtype=np.int64)
        re_a = np.asarray(re, dtype=np.int64)
        keep = lo_a >= 0
        out_l.append(lo_a[keep])
        out_r.append(re_a[keep])
    return out_l, out_r


def _validate(req: PullRequest, sidecar: Sidecar) -> None:
    """Shape checks an engine gets back as a 422 naming the field."""
    local = sidecar.manifest
    assert local is not None
    if not req.tickets:
        raise BlockIdError("tickets", "at least one ticket is needed")
    tp = req.tickets[0].tp_size
    for i, t in enumerate(req.tickets):
        if t.tp_size != tp or t.tp_rank != i:
            raise BlockIdError(
                f"tickets[{i}]", f"expected rank {i} of {tp}, got rank {t.tp_rank} of {t.tp_size}"
            )
        if t.block_ids != req.tickets[0].block_ids:
            raise BlockIdError(f"tickets[{i}].block_ids", "differs from tickets[0].block_ids")
    if len(req.tickets) != tp:
        raise BlockIdError("tickets", f"{len(req.tickets)} tickets for prefill TP {tp}")
    remote = req.tickets[0].block_ids
    if len(req.block_ids) != len(local.groups):
        raise BlockIdError(
            "block_ids", f"{len(req.block_ids)} groups given, the manifest has {len(local.groups)}"
        )
    if len(remote) != len(local.groups):
        raise BlockIdError(
            "tickets[0].block_ids",
            f"{len(remote)} groups in the ticket, the manifest has {len(local.groups)}",
        )
    for g, (lo, re) in enumerate(zip(req.block_ids, remote, strict=True)):
        if len(lo) != len(re):
            raise BlockIdError(f"block_ids[{g}]", f"{len(lo)} local ids for {len(re)} ticket ids")
        for k, b in enumerate(lo):
            if b < -1 or b >= local.num_blocks:
                raise BlockIdError(
                    f"block_ids[{g}][{k}]", f"{b} is outside 0..{local.num_blocks - 1} (or -1)"
                )
    if req.deadline_s <= 0:
        raise BlockIdError("deadline_s", "must be > 0")
