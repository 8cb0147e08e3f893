"""The prefill side of a transfer: the engine's holds (hold, abort) and what reading (decode)
sidecars ask of them (handshake, claim, heartbeat, decline), apart from the decode side's pulls."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvxferd.config import Config
from kvxferd.errors import DuplicateHoldError, IncompatiblePeerError
from kvxferd.metrics import Metrics
from kvxferd.sidecar.clocks import act_by, wall_time
from kvxferd.sidecar.handshake import mismatch
from kvxferd.sidecar.hold_request import check_hold_rank
from kvxferd.sidecar.notifs import NotificationPoller
from kvxferd.sidecar.placements import Placements
from kvxferd.sidecar.pull_request import ReaderCounts
from kvxferd.sidecar.registered import Registered
from kvxferd.sidecar.tickets import check_addressed, sign_ticket, verify_ticket, verify_tickets
from kvxferd.transport import Agent
from kvxferd.wire import (
    AbortHoldRequest,
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
    HoldRequest,
    Ticket,
)

log = logging.getLogger(__name__)


class PrefillSide:
    """The registered engine's holds and its readers' calls on them (``Sidecar``'s ``hold``,
    ``abort``, ``accept_handshake``, ``claim``, ``heartbeat`` and ``accept_decline``)."""

    def __init__(
        self, registered: Registered, config: Config, *, engine_id: str, epoch: int,
        peer_address: Callable[[], str], secret: bytes, accepted: tuple[bytes, ...],
        placements: Placements, agent: Agent, metrics: Metrics, notifs: NotificationPoller,
        after_release: Callable[[], None], local_handshake: Callable[[], Handshake],
    ) -> None:  # fmt: skip
        self._registered = registered
        self._config = config
        self._engine_id = engine_id
        self._epoch = epoch
        self._peer_address = peer_address  # host:port once the peer server is bound
        self._secret = secret  # signs our tickets
        self._accepted = accepted
        self._placements = placements  # claims waiting for their hold to be placed
        self._agent = agent
        self._metrics = metrics
        self._notifs = notifs
        self._after_release = after_release
        self._local_handshake = local_handshake
        self._readers = ReaderCounts()

    # ---------------------------------------------------------------- the engine's calls

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin a request's blocks under a lease; the ticket authorises one pull of them."""
        registered, metrics = self._registered, self._metrics
        holds, manifest = registered.require_memory()
        in_time = lambda: act_by(req.not_after_ns, metrics.calls_expired.labels("hold").inc)  # noqa: E731
        check = lambda: (registered.check_generation(req.generation), in_time())  # noqa: E731
        if (pod := registered.pod) is None:
            check_hold_rank(req.tp_rank, manifest.tp_rank)
            registered.check_generation(req.generation)
        elif ticket := pod.place(req, req.hold_id in holds, self._placements, check):
            return ticket  # a later rank's placement (one that came late gives the hold up)
        held = holds.counters.held
        try:
            hold = holds.hold(req, checked=in_time)  # the same hold placed again is that hold
        except DuplicateHoldError:  # a request placed twice: its live hold was given up
            self._after_release()
            raise
        if pod is None:
            self._placements.placed(hold.hold_id)  # a claim for this engine-chosen id came first
        metrics.holds_created.inc(holds.counters.held - held)
        self._notifs.wake.set()  # a READ may come before its claim: progress UCX promptly
        metrics.holds_active.set(holds.active)
        signed = sign_ticket(Ticket(
            engine_id=self._engine_id,
            epoch=self._epoch,
            hold_id=hold.hold_id,
            request_id=req.request_id,
            block_ids=req.block_ids,
            num_tokens=req.num_tokens,
            expires_at=wall_time(hold.expires_at),
            tp_rank=manifest.tp_rank,
            tp_size=manifest.tp_size,
            peer=self._peer_address(),
            generation=registered.generation,
            ranks=self._config.pod_ranks,
        ), self._secret)  # fmt: skip
        return pod.placements.first(req, signed) if pod is not None else signed

    def abort(self, req: AbortHoldRequest) -> None:
        """Give up a hold: released now, or, while a reader that claimed it may be reading,
        once its readers are done (``HoldTable.abort``); the released feed says when."""
        holds, _ = self._registered.require_engine()
        try:
            holds.abort(req.hold_id)
        finally:  # an id no hold has is never placed now: a claim waiting for it ends at once
            self._placements.placed(req.hold_id)
        self._after_release()

    # ---------------------------------------------------------------- its readers' calls

    async def accept_handshake(self, theirs: Handshake) -> Handshake:
        """Answer a reader's handshake with ours (after checking compatibility)."""
        _, manifest = self._registered.require_engine()
        diff = mismatch(manifest, theirs, self._agent.tcp_segments[0])
        if diff:
            self._metrics.handshakes.labels("incompatible").inc()
            raise IncompatiblePeerError(diff)
        self._metrics.handshakes.labels("accepted").inc()
        return self._local_handshake()

    async def claim(self, req: ClaimRequest) -> ClaimResponse:
        """Pin a hold for a reader; unknown -> 404, expired -> 410 (and released).

        Checked first: the ticket's MAC (401), that it names this engine epoch and registration
        generation (404), this rank's TP shape (409) and a reader TP size the manifest allows
        (422). The hold must have the ticket's block ids (409). An engine-chosen hold id not
        placed yet is waited for up to ``hold_grace_s`` (the generation is checked again
        after: a hold placed under a newer registration is not the ticket's). No claim while a
        registered segment is shrunk (422 SegmentTooSmallError).
        """
        registered, pod = self._registered, self._registered.pod
        _, manifest = registered.require_memory()
        ticket = req.ticket
        verify_ticket(ticket, self._accepted)
        ranks, engine_id, epoch = self._config.pod_ranks, self._engine_id, self._epoch
        check_addressed(ticket, engine_id, epoch, registered.generation, manifest, ranks)
        readers = self._readers.expected(manifest, req.reader_tp_size, pod is not None)
        await self._await_hold(ticket.hold_id)
        holds, manifest = registered.require_engine()  # again: it may have re-registered meanwhile
        check_addressed(ticket, engine_id, epoch, registered.generation, manifest, ranks)
        if pod is not None:  # a rank never placed it: given up
            pod.check_placed(ticket.hold_id, self._placements)
        try:
            grant = holds.claim(
                ticket.hold_id, req.reader, req.claim_s, readers,
                block_ids=ticket.block_ids, request_id=ticket.request_id,
                reader_tp_size=req.reader_tp_size,
            )  # fmt: skip
        finally:
            self._after_release()
        self._notifs.claimed(holds)  # progress now: the READ may wait on our UCX worker
        return ClaimResponse(
            hold_id=grant.hold_id,
            expires_at=wall_time(grant.expires_at),
            expected_readers=readers,
            claim_s=grant.granted_s,
        )

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        """Extend leases of still-queued requests."""
        holds, _ = self._registered.require_engine()
        extended, missing = holds.heartbeat(req.hold_ids, req.extend_s)
        return HeartbeatResponse(extended=list(extended), missing=list(missing))

    def accept_decline(self, req: DeclineRequest) -> DeclineResponse:
        """Release holds a decode side will not read (``declined``). Every ticket's MAC is
        checked first (401 naming it); a ticket whose hold is gone, belongs to another engine
        epoch or registration generation or has other block ids or request is ``missing``; a
        claimed hold is ``busy`` (kept)."""
        holds, _ = self._registered.require_engine()
        verify_tickets(req.tickets, self._accepted)
        ours = (self._engine_id, self._epoch, self._registered.generation)
        out = holds.decline_tickets(req.tickets, ours)
        self._after_release()
        if out.released:
            log.info("declined (%s): %d holds released", req.reason or "no reason",
                     len(out.released))  # fmt: skip
        return out

    async def _await_hold(self, hold_id: str) -> None:
        """Wait (up to ``hold_grace_s``) for a hold that is neither live nor released yet."""
        holds, pod = self._registered.holds, self._registered.pod
        grace = self._config.hold_grace_s
        pending = pod is not None and pod.placements.pending(hold_id)
        if holds is None or grace <= 0 or holds.was_released(hold_id) or (
                hold_id in holds and not pending):  # fmt: skip
            return
        await self._placements.wait(hold_id, grace)


__all__ = ["PrefillSide"]
