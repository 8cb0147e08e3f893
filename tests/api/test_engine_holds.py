"""Holds through the engine API of a real sidecar: signed tickets, block ids and request ids
checked and named, a second hold of a live request, aborts."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from kvxferd.wire import HOLD_SPARE_BLOCKS, MAX_TOKENS, ReleasedHolds, Ticket
from tests.api.engine_calls import error_of, hold_body


def test_a_hold_returns_a_signed_ticket_for_this_rank(real):
    body = hold_body(block_ids=[[1, 2]])
    resp = real.engine.post("/v1/holds", json=body)
    assert resp.status_code == 200, resp.text
    ticket = msgspec.json.decode(resp.content, type=Ticket)
    assert (ticket.engine_id, ticket.request_id, ticket.block_ids) == (
        "api-test", body["request_id"], [[1, 2]])  # fmt: skip
    assert ticket.peer == "127.0.0.1:9" and len(ticket.token) == 64


@pytest.mark.parametrize(
    ("block_ids", "field"),
    [([[1, 8]], "block_ids[0][1]"), ([[1, -1]], "block_ids[0][1]"),
     ([[3, 3]], "block_ids[0][1]"), ([[1], [2]], "block_ids")],
    ids=["past-the-end", "negative", "repeated", "wrong-group-count"],
)  # fmt: skip
def test_a_hold_with_bad_block_ids_is_a_422_naming_the_block(real, block_ids, field):
    err = error_of(real.engine.post("/v1/holds", json=hold_body(block_ids=block_ids)), 422)
    assert (err.error, err.field) == ("BlockIdError", field)


def test_a_hold_past_max_tokens_or_listing_more_blocks_than_they_span_is_a_422_naming_it(real):
    before = real.sidecar.holds.active
    err = error_of(real.engine.post("/v1/holds", json=hold_body(num_tokens=MAX_TOKENS + 1)), 422)
    assert (err.error, err.field) == ("HoldRequestError", "num_tokens")
    block_size = real.manifest.groups[0].block_size
    most = -(-20 // block_size) + HOLD_SPARE_BLOCKS
    flood = [0] * most + [99]  # one null too many, and a bad id never looked at
    err = error_of(real.engine.post("/v1/holds", json=hold_body(block_ids=[flood])), 422)
    assert (err.error, err.field) == ("BlockIdError", "block_ids[0]")
    assert real.sidecar.holds.active == before


@pytest.mark.parametrize("ids", [[1 << 63], [1, 1 << 63], [1, (1 << 64) - 1]])
def test_a_hold_id_past_int64_is_a_422_naming_that_entry_and_its_value(real, ids):
    # msgpack carries them: one read back wrapped (-2**63), a mix with small ids as floats.
    body = msgspec.msgpack.encode(hold_body(block_ids=[ids]))
    resp = real.engine.post("/v1/holds", content=body,
                            headers={"Content-Type": "application/msgpack"})  # fmt: skip
    err = error_of(resp, 422)
    assert (err.error, err.field) == ("BlockIdError", f"block_ids[0][{len(ids) - 1}]")
    assert f"id {ids[-1]} outside" in err.detail


def test_a_hold_naming_another_tp_rank_than_the_sidecars_one_is_a_422_naming_tp_rank(real):
    # tp_rank is a pod sidecar's field; here it was ignored: rank 3's hold placed as rank 0's.
    before = real.sidecar.holds.active
    err = error_of(real.engine.post("/v1/holds", json=hold_body(tp_rank=3)), 422)
    assert (err.error, err.field) == ("HoldRequestError", "tp_rank")
    assert real.sidecar.holds.active == before
    resp = real.engine.post("/v1/holds", json=hold_body(tp_rank=real.manifest.tp_rank))
    assert resp.status_code == 200, resp.text  # its own rank, as -1


@pytest.mark.parametrize("hold_id", ["x" * 129, "h\nkvxferd ready", "a b"],
                         ids=["129", "newline", "space"])  # fmt: skip
def test_a_hold_id_too_long_or_with_other_characters_is_a_422_naming_it(real, hold_id):
    before = real.sidecar.holds.active
    err = error_of(real.engine.post("/v1/holds", json=hold_body(hold_id=hold_id)), 422)
    assert (err.error, err.field) == ("ValidationError", "hold_id")
    err = error_of(real.engine.post("/v1/holds/abort", json={"hold_id": hold_id}), 422)
    assert (err.error, err.field) == ("ValidationError", "hold_id")
    assert real.sidecar.holds.active == before


def test_a_second_hold_of_a_live_request_is_a_409_naming_request_id_and_gives_the_first_up(real):
    body, before = hold_body(), real.sidecar.holds.active
    cursor = real.engine.get("/v1/released?cursor=0").json()["cursor"]
    first = real.engine.post("/v1/holds", json=body).json()
    err = error_of(real.engine.post("/v1/holds", json=body), 409)
    assert (err.error, err.field) == ("DuplicateHoldError", "request_id")
    # The engine frees a refused request's blocks: the first hold is released, not read.
    feed = real.engine.get(f"/v1/released?cursor={cursor}").json()
    assert [(h["hold_id"], h["reason"]) for h in feed["holds"]] == [(first["hold_id"], "aborted")]
    assert real.sidecar.holds.active == before


def test_the_same_hold_placed_again_is_answered_its_ticket_again(real):
    body, before = {**hold_body(), "hold_id": "h-again"}, real.sidecar.holds.active
    first = real.engine.post("/v1/holds", json=body).json()
    again = real.engine.post("/v1/holds", json=body).json()
    # Signed again: the same hold and lease (expires_at is the lease's end read off the wall
    # clock at signing, so it may differ in its last digits, and with it the MAC).
    same = {k: v for k, v in first.items() if k not in ("expires_at", "token")}
    assert {k: v for k, v in again.items() if k not in ("expires_at", "token")} == same
    assert real.sidecar.holds.active == before + 1


@pytest.mark.parametrize(
    "request_id",
    ["r\nkvxferd ready", "r\n", "r\x1b[2J", "x" * 513],
    ids=["newline", "trailing-newline", "escape", "513-characters"],
)
def test_a_hold_with_a_request_id_that_is_too_long_or_has_a_control_character_is_a_422(
    real, request_id
):
    before = real.sidecar.holds.active
    err = error_of(real.engine.post("/v1/holds", json=hold_body(request_id=request_id)), 422)
    assert (err.error, err.field) == ("ValidationError", "request_id")
    assert real.sidecar.holds.active == before


def test_a_hold_with_a_512_character_request_id_is_placed_and_its_ticket_names_it(real):
    request_id = uuid.uuid4().hex.ljust(512, "\t")
    resp = real.engine.post("/v1/holds", json=hold_body(request_id=request_id))
    assert resp.status_code == 200, resp.text
    ticket = msgspec.json.decode(resp.content, type=Ticket)
    assert ticket.request_id == request_id
    assert real.engine.post("/v1/holds/abort", json={"hold_id": ticket.hold_id}).status_code == 204


def test_abort_releases_once_then_the_hold_is_unknown(real):
    ticket = msgspec.json.decode(
        real.engine.post("/v1/holds", json=hold_body(block_ids=[[4]])).content, type=Ticket
    )
    cursor = msgspec.json.decode(real.engine.get("/v1/released").content, type=ReleasedHolds)
    assert real.engine.post("/v1/holds/abort", json={"hold_id": ticket.hold_id}).status_code == 204
    err = error_of(real.engine.post("/v1/holds/abort", json={"hold_id": ticket.hold_id}), 404)
    assert err.error == "UnknownHoldError"
    feed = msgspec.json.decode(
        real.engine.get(f"/v1/released?cursor={cursor.cursor}").content, type=ReleasedHolds
    )
    assert [(h.hold_id, h.reason, h.block_ids) for h in feed.holds] == [
        (ticket.hold_id, "aborted", [[4]])
    ]
