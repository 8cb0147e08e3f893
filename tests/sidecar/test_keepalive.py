"""Grouping a keepalive's tickets by prefill sidecar: MACs checked, repeats once, order kept; a
prefill side's answer is kept to the holds asked about, each once a list, so the merged answer
stays within the call's tickets (MAX_TICKETS_PER_CALL a list)."""

from __future__ import annotations

import asyncio
import re

import msgspec
import pytest
from msgspec import structs

from kvxferd.errors import AuthError
from kvxferd.sidecar.keepalive import decline_at_peers, holds_by_peer, keep_alive
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    MAX_TICKETS_PER_CALL,
    DeclineRequest,
    DeclineResponse,
    HeartbeatResponse,
    KeepaliveRequest,
    Ticket,
)

SECRET = b"keepalive-secret"


def _ticket(hold_id: str, peer: str, rank: int = 0) -> Ticket:
    t = Ticket(engine_id="p", epoch=1, hold_id=hold_id, request_id=f"r-{hold_id}",
               block_ids=[[1]], num_tokens=16, expires_at=100.0, tp_rank=rank, tp_size=2,
               peer=peer)  # fmt: skip
    return sign_ticket(t, SECRET)


def test_hold_ids_are_grouped_by_peer_in_first_seen_order_repeats_once():
    tickets = [_ticket("a", "p1:1"), _ticket("b", "p2:1", 1), _ticket("c", "p1:1"),
               _ticket("a", "p1:1")]  # fmt: skip
    assert holds_by_peer(tickets, SECRET) == {"p1:1": ["a", "c"], "p2:1": ["b"]}
    assert holds_by_peer([], SECRET) == {}


@pytest.mark.parametrize(
    ("mutate", "detail"),
    [
        (lambda t: structs.replace(t, hold_id="other"), "tickets[1].token: does not match"),
        (lambda t: structs.replace(t, token=""), "tickets[1].token: missing"),
    ],
    ids=["tampered", "unsigned"],
)
def test_a_ticket_whose_mac_does_not_match_is_named(mutate, detail):
    tickets = [_ticket("a", "p1:1"), mutate(_ticket("b", "p1:1"))]
    with pytest.raises(AuthError, match="^" + re.escape(detail)):
        holds_by_peer(tickets, SECRET)
    with pytest.raises(AuthError):
        holds_by_peer([_ticket("a", "p1:1")], b"another-secret")


class _Repeating:
    """Prefill sides that name every hold they were asked about ``times`` times, each in one of
    their lists (hold i in list i mod the lists): the peer table refuses an answer naming a hold
    in two lists (tests/sidecar/test_hold_answers.py), so none reaches the merge."""

    def __init__(self, times: int) -> None:
        self.times = times

    def _lists(self, ids: list[str], names: tuple[str, ...]) -> dict[str, list[str]]:
        return {n: [h for h in ids[i :: len(names)] for _ in range(self.times)]
                for i, n in enumerate(names)}  # fmt: skip

    async def heartbeat(self, _peer: str, req) -> HeartbeatResponse:  # noqa: ANN001
        return HeartbeatResponse(**self._lists(list(req.hold_ids), ("extended", "missing")))

    async def decline(self, _peer: str, req) -> DeclineResponse:  # noqa: ANN001
        ids = [t.hold_id for t in req.tickets]
        return DeclineResponse(**self._lists(ids, ("released", "missing", "busy")))


def test_a_hold_a_prefill_side_names_repeatedly_in_its_list_counts_once():
    tickets = [_ticket(f"h{i}", f"p{i % 2}:1", i % 2) for i in range(MAX_TICKETS_PER_CALL)]
    peers = _Repeating(times=4)  # 2048 holds asked of each peer: lists at their bound
    kept = asyncio.run(keep_alive(peers, KeepaliveRequest(tickets=tickets, extend_s=1), SECRET))
    declined = asyncio.run(decline_at_peers(peers, DeclineRequest(tickets=tickets), SECRET))
    ids = sorted(t.hold_id for t in tickets)
    assert sorted(kept.extended + kept.missing) == ids and kept.unanswered == []
    assert sorted(declined.released + declined.missing + declined.busy) == ids
    assert declined.unanswered == [] and declined.busy and kept.missing  # every list used
    for answer in (kept, declined):  # the engine's client decodes it within the bounds
        assert msgspec.json.decode(msgspec.json.encode(answer), type=type(answer)) == answer
