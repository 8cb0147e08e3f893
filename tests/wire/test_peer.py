"""Peer API messages: a heartbeat's hold ids are hold ids, at most MAX_TICKETS_PER_CALL of them
(bounded, named by index)."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.wire import MAX_TICKETS_PER_CALL, Heartbeat


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
