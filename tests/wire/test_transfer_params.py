"""kv_transfer_params: the prefill's answer round-trips; bad tickets are named precisely."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.errors import InvalidRequestError
from kvxferd.wire import MAX_BLOCK_IDS, MAX_TP, Ticket
from kvxferd.wire import transfer_params as tp


def _ticket(rank: int, size: int) -> Ticket:
    return Ticket(engine_id=f"e{rank}", epoch=1, hold_id=f"h{rank}", request_id="r",
                  block_ids=[[3, 1], [2]], num_tokens=20, expires_at=1.0, tp_rank=rank,
                  tp_size=size, peer="127.0.0.1:4567", token="ab")  # fmt: skip


def test_prefill_answer_has_vllm_fields_and_tickets_that_parse_back():
    tickets = [_ticket(0, 2), _ticket(1, 2)]
    params = tp.prefill_answer(engine_id="sim1", request_id="r", peer="127.0.0.1:4567",
                               tickets=tickets)  # fmt: skip
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[3, 1], [2]]
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 4567)
    assert (params["remote_engine_id"], params["remote_request_id"], params["tp_size"]) == (
        "sim1", "r", 2)  # fmt: skip
    wire = msgspec.json.decode(msgspec.json.encode(params))
    assert tp.has_remote_prefill(wire) and not tp.wants_remote_decode(wire)
    assert tp.parse_tickets(wire) == tickets


def test_stub_from_a_proxy_asks_for_remote_decode():
    stub = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
    assert tp.wants_remote_decode(stub) and not tp.has_remote_prefill(stub)
    assert not tp.wants_remote_decode(None) and not tp.has_remote_prefill("x")


@pytest.mark.parametrize(
    ("tickets", "field"),
    [
        (None, "kv_transfer_params.kvxferd_tickets"),
        ([], "kv_transfer_params.kvxferd_tickets"),
        ([{"engine_id": "e"}], "kv_transfer_params.kvxferd_tickets[0]"),
        ([{**msgspec.to_builtins(_ticket(0, 1)), "epoch": "x"}],
         "kv_transfer_params.kvxferd_tickets[0].epoch"),
        ([msgspec.to_builtins(_ticket(1, 2)), msgspec.to_builtins(_ticket(0, 2))],
         "kv_transfer_params.kvxferd_tickets[0]"),
        ([{**msgspec.to_builtins(_ticket(0, 1)), "engine_id": "e0\nkvxferd ready"}],
         "kv_transfer_params.kvxferd_tickets[0].engine_id"),
        ([{**msgspec.to_builtins(_ticket(0, 1)), "tp_size": MAX_TP + 1}],
         "kv_transfer_params.kvxferd_tickets[0].tp_size"),
        ([None] * (MAX_TP + 1), "kv_transfer_params.kvxferd_tickets"),  # refused before any
    ],
)  # fmt: skip
def test_bad_tickets_name_the_field(tickets, field):
    with pytest.raises(InvalidRequestError) as info:
        tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": tickets})
    assert info.value.field == field


def test_a_ticket_group_of_more_than_max_block_ids_is_named_before_its_ids_are_converted():
    flood = [0] * MAX_BLOCK_IDS + ["x"]  # an id that is not one: never reached
    ticket = {**msgspec.to_builtins(_ticket(0, 1)), "block_ids": [[1], flood]}
    with pytest.raises(InvalidRequestError) as info:
        tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": [ticket]})
    assert info.value.field == "kv_transfer_params.kvxferd_tickets[0].block_ids[1]"
    assert f"<= {MAX_BLOCK_IDS}" in info.value.reason


@pytest.mark.parametrize("value", ["7", 7.0, True, None, -1, 301, [7]])
def test_an_integer_field_outside_its_range_or_of_another_type_is_named(value):
    with pytest.raises(InvalidRequestError) as info:
        tp.int_field({"remote_num_tokens": value}, "remote_num_tokens", 0, low=0, high=300)
    assert info.value.field == "kv_transfer_params.remote_num_tokens"


def test_an_absent_integer_field_takes_its_default_and_bounds_are_inclusive():
    assert tp.int_field({}, "remote_block_size", 16, low=1, high=64) == 16
    assert tp.int_field({"n": 0}, "n", 5, low=0, high=3) == 0
    assert tp.int_field({"n": 3}, "n", 5, low=0, high=3) == 3


def test_an_unknown_ticket_field_is_named_on_one_line():
    # The field's name is the sender's text, and the connector logs the error (as the sim does).
    ticket = {**msgspec.to_builtins(_ticket(0, 1)), "x\nkvxferd ready\u2028\x9b": 1}
    with pytest.raises(InvalidRequestError) as info:
        tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": [ticket]})
    assert info.value.field == "kv_transfer_params.kvxferd_tickets[0]"
    assert str(info.value).endswith("unknown field `x\\nkvxferd ready\\u2028\\x9b`")
    assert str(info.value).splitlines() == [str(info.value)]


def _pod(rank: int, size: int, ranks: int) -> dict:
    return {**msgspec.to_builtins(_ticket(rank, size)), "ranks": ranks}


def test_a_prefill_pods_one_ticket_parses_alone():
    """A pod sidecar's ticket (rank 0 of TP N, ``ranks`` N) is the pull's only ticket."""
    (ticket,) = tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": [_pod(0, 2, 2)]})
    assert (ticket.tp_rank, ticket.tp_size, ticket.ranks) == (0, 2, 2)


@pytest.mark.parametrize(
    ("tickets", "field"),
    [
        ([_pod(1, 2, 2)], "kv_transfer_params.kvxferd_tickets[0]"),  # not rank 0
        ([_pod(0, 4, 2)], "kv_transfer_params.kvxferd_tickets[0]"),  # spans part of TP 4
        ([_pod(0, 2, 2), _pod(1, 2, 2)], "kv_transfer_params.kvxferd_tickets[0].ranks"),
        ([msgspec.to_builtins(_ticket(0, 2)), _pod(1, 2, 2)],
         "kv_transfer_params.kvxferd_tickets[1].ranks"),
    ],
)  # fmt: skip
def test_a_pod_ticket_that_is_not_alone_or_not_rank_0_of_every_rank_is_named(tickets, field):
    with pytest.raises(InvalidRequestError) as info:
        tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": tickets})
    assert info.value.field == field
