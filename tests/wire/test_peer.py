"""Peer API messages: a heartbeat's hold ids are hold ids, at most MAX_TICKETS_PER_CALL of them
(bounded, named by index), and so are each list of a heartbeat's or decline's answer; a claimed
ticket's groups list at most MAX_BLOCK_IDS ids; a handshake gives at most MAX_REGIONS bases."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.layout.planner import PlanOptions, plan_manifest
from kvxferd.layout.presets import load_hf_config
from kvxferd.wire import (
    MAX_BLOCK_IDS,
    MAX_REGIONS,
    MAX_TICKETS_PER_CALL,
    ClaimRequest,
    DeclineResponse,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
)


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


_ANSWERS = [(HeartbeatResponse, f) for f in ("extended", "missing", "unanswered")] + [
    (DeclineResponse, f) for f in ("released", "missing", "busy", "unanswered")
]


@pytest.mark.parametrize(("kind", "field"), _ANSWERS, ids=lambda v: getattr(v, "__name__", v))
def test_an_answer_names_at_most_max_tickets_per_call_holds_a_list(kind, field):
    lists = {f: [] for f in kind.__struct_fields__}
    most = [f"h-{i}" for i in range(MAX_TICKETS_PER_CALL)]
    body = msgspec.msgpack.encode({**lists, field: most})
    assert len(getattr(msgspec.msgpack.decode(body, type=kind), field)) == MAX_TICKETS_PER_CALL
    flood = msgspec.Raw(b"\xdd" + (MAX_TICKETS_PER_CALL + 1).to_bytes(4, "big"))  # count alone
    with pytest.raises(msgspec.ValidationError, match=rf"at `\$\.{field}`$"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**lists, field: flood}), type=kind)


def test_a_handshake_gives_at_most_max_regions_region_bases():
    manifest = msgspec.to_builtins(plan_manifest(load_hf_config("llama-3.1-8b"), PlanOptions()))
    body = {"protocol_version": 1, "engine_id": "e", "epoch": 1, "agent_name": "a",
            "agent_metadata": b"", "manifest": manifest}  # fmt: skip
    most = msgspec.msgpack.encode({**body, "region_bases": [0] * MAX_REGIONS})
    assert len(msgspec.msgpack.decode(most, type=Handshake).region_bases) == MAX_REGIONS
    flood = msgspec.Raw(b"\xdd" + (MAX_REGIONS + 1).to_bytes(4, "big"))  # the count alone
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.region_bases`$"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**body, "region_bases": flood}),
                               type=Handshake)  # fmt: skip
