"""Decode-side keepalive: extend the prefill holds of requests still queued on this engine.

The engine hands its sidecar the tickets of its queued requests; the sidecar checks each ticket's
MAC, groups the hold ids by prefill sidecar (``Ticket.peer``) and sends every one a heartbeat,
all at once, each bounded by the peer table's timeout. A prefill sidecar that gives no usable
answer does not fail the others: its holds come back ``unanswered``.
"""

from __future__ import annotations

import asyncio
import logging
import math

from kvxferd.errors import AuthError, HoldRequestError, KvxferdError
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.tickets import verify_ticket
from kvxferd.wire import Heartbeat, HeartbeatResponse, KeepaliveRequest, Ticket

log = logging.getLogger(__name__)


def holds_by_peer(tickets: list[Ticket], secret: bytes) -> dict[str, list[str]]:
    """Peer address -> its hold ids (first-seen order, repeats once); AuthError names a ticket
    whose MAC does not match."""
    out: dict[str, dict[str, None]] = {}
    for i, ticket in enumerate(tickets):
        try:
            verify_ticket(ticket, secret)
        except AuthError as exc:
            raise AuthError(f"tickets[{i}].{str(exc).removeprefix('ticket.')}") from None
        out.setdefault(ticket.peer, {})[ticket.hold_id] = None
    return {peer: list(ids) for peer, ids in out.items()}


async def keep_alive(
    peers: PeerTable, request: KeepaliveRequest, secret: bytes
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
