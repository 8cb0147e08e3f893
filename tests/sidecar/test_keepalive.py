"""Grouping a keepalive's tickets by prefill sidecar: MACs checked, repeats once, order kept."""

from __future__ import annotations

import re

import pytest
from msgspec import structs

from kvxferd.errors import AuthError
from kvxferd.sidecar.keepalive import holds_by_peer
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import Ticket

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
