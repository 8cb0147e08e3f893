"""Decode-side calls about holds of requests this engine has not read: keepalive and decline.

Keepalive extends the prefill holds of requests still queued here; decline releases the holds
of requests this engine will not read (rejected, aborted). Either way the engine hands its
sidecar the tickets; the sidecar checks every ticket's MAC before any network call, groups them
by prefill sidecar (``Ticket.peer``) and calls every one at once, each bounded by the peer
table's timeout. A prefill sidecar that gives no usable answer does not fail the others: its
holds come back ``unanswered``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

from kvxferd.errors import HoldRequestError, KvxferdError
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.tickets import verify_tickets
from kvxferd.wire import (
    DeclineRequest,
    DeclineResponse,
    Heartbeat,
    HeartbeatResponse,
    KeepaliveRequest,
    Ticket,
)

log = logging.getLogger(__name__)


def holds_by_peer(tickets: list[Ticket], secret: bytes | Iterable[bytes]) -> dict[str, list[str]]:
    """Peer address -> its hold ids (first-seen order, repeats once); AuthError names a ticket
    whose MAC does not match."""
    return {peer: [t.hold_id for t in group] for peer, group in tickets_by_peer(
        tickets, secret).items()}  # fmt: skip


def tickets_by_peer(
    tickets: list[Ticket], secret: bytes | Iterable[bytes]
) -> dict[str, list[Ticket]]:
    """Peer address -> its tickets (first-seen order, one per hold id), every MAC checked
    first (AuthError naming ``tickets[i].token``)."""
    verify_tickets(tickets, secret)
    out: dict[str, dict[str, Ticket]] = {}
    for ticket in tickets:
        out.setdefault(ticket.peer, {}).setdefault(ticket.hold_id, ticket)
    return {peer: list(group.values()) for peer, group in out.items()}


async def decline_at_peers(
    peers: PeerTable, request: DeclineRequest, secret: bytes | Iterable[bytes]
) -> DeclineResponse:
    """One decline per prefill sidecar; their answers merged (peer order, then theirs)."""
    grouped = tickets_by_peer(request.tickets, secret)
    answers = await asyncio.gather(
        *(_decline(peers, peer, group, request.reason) for peer, group in grouped.items())
    )
    return DeclineResponse(
        released=[h for a in answers for h in a.released],
        missing=[h for a in answers for h in a.missing],
        busy=[h for a in answers for h in a.busy],
        unanswered=[h for a in answers for h in a.unanswered],
    )


async def _decline(
    peers: PeerTable, peer: str, tickets: list[Ticket], reason: str
) -> DeclineResponse:
    hold_ids = [t.hold_id for t in tickets]
    try:
        answer = await peers.decline(peer, DeclineRequest(tickets=tickets, reason=reason))
    except KvxferdError as exc:
        log.warning("decline of %d holds at %s failed: %s", len(hold_ids), peer, exc)
        return DeclineResponse(released=[], missing=[], unanswered=hold_ids)
    asked = set(hold_ids)
    released = [h for h in answer.released if h in asked]
    missing = [h for h in answer.missing if h in asked]
    busy = [h for h in answer.busy if h in asked]
    told = set(released) | set(missing) | set(busy)
    return DeclineResponse(
        released=released, missing=missing, busy=busy,
        unanswered=[h for h in hold_ids if h not in told],
    )  # fmt: skip


async def keep_alive(
    peers: PeerTable, request: KeepaliveRequest, secret: bytes | Iterable[bytes]
) -> HeartbeatResponse:
    """One heartbeat per prefill sidecar; their answers merged (peer order, then theirs)."""
    extend_s = request.extend_s
    if not (math.isfinite(extend_s) and extend_s > 0):
        raise HoldRequestError("extend_s", f"must be a finite number > 0, got {extend_s!r}")
    grouped = holds_by_peer(request.tickets, secret)
    answers = await asyncio.gather(
        *(_ask(peers, peer, ids, extend_s) for peer, ids in grouped.items())
    )
    return HeartbeatResponse(
        extended=[h for a in answers for h in a.extended],
        missing=[h for a in answers for h in a.missing],
        unanswered=[h for a in answers for h in a.unanswered],
    )


async def _ask(
    peers: PeerTable, peer: str, hold_ids: list[str], extend_s: float
) -> HeartbeatResponse:
    try:
        answer = await peers.heartbeat(peer, Heartbeat(hold_ids=hold_ids, extend_s=extend_s))
    except KvxferdError as exc:
        log.warning("keepalive: heartbeat of %d holds at %s failed: %s", len(hold_ids), peer, exc)
        return HeartbeatResponse(extended=[], missing=[], unanswered=hold_ids)
    asked = set(hold_ids)
    extended = [h for h in answer.extended if h in asked]
    missing = [h for h in answer.missing if h in asked]
    # A hold the peer did not mention either way is not known to be alive.
    told = set(extended) | set(missing)
    return HeartbeatResponse(
        extended=extended, missing=missing, unanswered=[h for h in hold_ids if h not in told]
    )
