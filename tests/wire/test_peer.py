"""Peer API messages: a heartbeat's hold ids are hold ids, at most MAX_TICKETS_PER_CALL of them
(bounded, named by index); a claimed ticket's groups list at most MAX_BLOCK_IDS ids."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.wire import MAX_BLOCK_IDS, MAX_TICKETS_PER_CALL, ClaimRequest, Heartbeat


def test_a_heartbeat_names_holds_by_their_ids():
    body = msgspec.json.encode({"hold_ids": ["a" * 32, "h-1"], "extend_s": 5.0})
    assert msgspec.json.decode(body, type=Heartbeat).hold_ids == ["a" * 32, "h-1"]


@pytest.mark.parametrize("hold_id", ["", "x" * 129, "h\n"], ids=["empty", "129", "newline"])
def test_a_heartbeat_hold_id_that_is_not_a_hold_id_is_refused_and_named(hold_id):
    body = msgspec.json.encode({"hold_ids": ["h-1", hold_id], "extend_s": 5.0})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.hold_ids\[1\]`$"):
        msgspec.json.decode(body, type=Heartbeat)


def test_a_heartbeat_names_at_most_max_tickets_per_call_holds():
    most = [f"h-{i}" for i in range(MAX_TICKETS_PER_CALL)]
    body = msgspec.json.encode({"hold_ids": most, "extend_s": 5.0})
    assert len(msgspec.json.decode(body, type=Heartbeat).hold_ids) == MAX_TICKETS_PER_CALL
    body = msgspec.json.encode({"hold_ids": [*most, "h-x"], "extend_s": 5.0})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.hold_ids`$"):
        msgspec.json.decode(body, type=Heartbeat)


def test_a_claim_whose_ticket_group_lists_more_than_max_block_ids_is_refused_and_named():
    flood = msgspec.Raw(b"\xdd" + (MAX_BLOCK_IDS + 1).to_bytes(4, "big") + bytes(MAX_BLOCK_IDS + 1))
    ticket = {"engine_id": "e", "epoch": 1, "hold_id": "h", "request_id": "r",
              "block_ids": [[1], flood], "num_tokens": 1, "expires_at": 0.0, "tp_rank": 0,
              "tp_size": 1, "peer": "h:1"}  # fmt: skip
    body = {"ticket": ticket, "reader": "agent", "reader_tp_size": 1, "claim_s": 5.0}
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.ticket\.block_ids\[1\]`$"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(body), type=ClaimRequest)
