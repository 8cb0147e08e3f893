"""kv_transfer_params: the prefill's answer round-trips; bad tickets are named precisely."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.errors import InvalidRequestError
from kvxferd.sim import transfer_params as tp
from kvxferd.wire import Ticket


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
    ],
)  # fmt: skip
def test_bad_tickets_name_the_field(tickets, field):
    with pytest.raises(InvalidRequestError) as info:
        tp.parse_tickets({"do_remote_prefill": True, "kvxferd_tickets": tickets})
    assert info.value.field == field
