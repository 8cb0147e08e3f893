"""Decode-side calls about holds of requests this engine has not read: keepalive and decline.

Keepalive extends the prefill holds of requests still queued here; decline releases the holds
of requests this engine will not read (rejected, aborted). Either way the engine hands its
sidecar the tickets; the sidecar checks every ticket's MAC before any network call, groups them
by prefill sidecar (``Ticket.peer``) and calls every one at once, each bounded by the peer
table's timeout. A prefill sidecar that gives no usable answer (unreachable, refused, or one
naming a hold it was not asked about or a hold in two lists: the peer table refuses it) does
not fail the others: its holds come back ``unanswered``, as does a hold an answer does not
mention; a hold an answer names twice in one list counts once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from typing import TypeVar

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

_Answer = TypeVar("_Answer", DeclineResponse, HeartbeatResponse)


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

    async def one(peer: str, tickets: list[Ticket]) -> DeclineResponse:
        ids = [t.hold_id for t in tickets]
        try:
            answer = await peers.decline(
                peer, DeclineRequest(tickets=tickets, reason=request.reason)
            )
        except KvxferdError as exc:
            log.warning("decline of %d holds at %s failed: %s", len(ids), peer, exc)
            answer = None
        return _for_asked(DeclineResponse, answer, ids)

    answers = await asyncio.gather(*(one(peer, group) for peer, group in grouped.items()))
    return _merged(DeclineResponse, answers)


async def keep_alive(
    peers: PeerTable, request: KeepaliveRequest, secret: bytes | Iterable[bytes]
) -> HeartbeatResponse:
    """One heartbeat per prefill sidecar; their answers merged (peer order, then theirs)."""
    extend_s = request.extend_s
    if not (math.isfinite(extend_s) and extend_s > 0):
        raise HoldRequestError("extend_s", f"must be a finite number > 0, got {extend_s!r}")
    grouped = holds_by_peer(request.tickets, secret)

    async def one(peer: str, ids: list[str]) -> HeartbeatResponse:
        try:
            answer = await peers.heartbeat(peer, Heartbeat(hold_ids=ids, extend_s=extend_s))
        except KvxferdError as exc:
            log.warning("keepalive: heartbeat of %d holds at %s failed: %s", len(ids), peer, exc)
            answer = None
        return _for_asked(HeartbeatResponse, answer, ids)

    answers = await asyncio.gather(*(one(peer, ids) for peer, ids in grouped.items()))
    return _merged(HeartbeatResponse, answers)


def _for_asked(cls: type[_Answer], answer: _Answer | None, asked: list[str]) -> _Answer:
    """A peer's answer kept to the holds we asked about, each once a list (so the merged answer
    stays within the call's tickets); a hold it did not mention either way (or every hold, when
    it gave no usable answer) is ``unanswered``: its lease is unknown."""
    wanted = set(asked)
    lists = {f: [h for h in dict.fromkeys(getattr(answer, f)) if h in wanted] if answer else []
             for f in cls.__struct_fields__ if f != "unanswered"}  # fmt: skip
    told = {h for ids in lists.values() for h in ids}
    return cls(**lists, unanswered=[h for h in asked if h not in told])


def _merged(cls: type[_Answer], answers: list[_Answer]) -> _Answer:
    """Every peer's answer in one (peer order, then theirs)."""
    return cls(**{f: [h for a in answers for h in getattr(a, f)] for f in cls.__struct_fields__})
