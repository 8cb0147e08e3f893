"""The engine API's lean path: the same routes and Structs as MessagePack. A msgpack body is
decoded when its Content-Type says so, the answer is msgpack when Accept asks for it (errors
included, the 4xx-with-field contract unchanged), and JSON stays the default and the only
format of the peer API."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from kvxferd import errors
from kvxferd.wire import ErrorBody, PullRequest, PullStatus, Ticket
from tests.api.conftest import post

MSGPACK = "application/msgpack"
SEND = {"Content-Type": MSGPACK}
BOTH = {"Content-Type": MSGPACK, "Accept": MSGPACK}


def _packed(resp, status: int, kind: type):
    """The msgpack answer of ``resp`` decoded as ``kind``; it must have ``status``."""
    assert resp.status_code == status, resp.content
    assert resp.headers["content-type"] == MSGPACK
    return msgspec.msgpack.decode(resp.content, type=kind)


def _error(resp, status: int) -> ErrorBody:
    return _packed(resp, status, ErrorBody)


def _hold(**changes) -> dict:
    body = {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[1, 2]], "num_tokens": 20}
    return {**body, **changes}


def _pull_body() -> dict:
    ticket = Ticket(engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]],
                    num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9",
                    token="00")  # fmt: skip
    return msgspec.to_builtins(PullRequest(tickets=[ticket], block_ids=[[3]], num_tokens=16))


# ------------------------------------------------------------------------------ negotiation


def test_a_msgpack_body_reaches_the_sidecar_as_the_same_struct_as_json(fake_engine, fake):
    body = _pull_body()
    fake_engine.post("/v1/pulls/run", json=body)
    fake_engine.post("/v1/pulls/run", content=msgspec.msgpack.encode(body), headers=SEND)
    (_, as_json), (_, as_msgpack) = fake.calls
    assert isinstance(as_msgpack, PullRequest) and as_msgpack == as_json


def test_the_answer_is_msgpack_only_when_accept_asks_for_it(fake_engine):
    raw = msgspec.msgpack.encode(_pull_body())
    plain = fake_engine.post("/v1/pulls/run", content=raw, headers=SEND)
    assert plain.headers["content-type"] == "application/json"
    assert msgspec.json.decode(plain.content, type=PullStatus).state == "done"
    packed = fake_engine.post("/v1/pulls/run", content=raw, headers=BOTH)
    assert _packed(packed, 200, PullStatus) == PullStatus(pull_id="p1", state="done", kv_bytes=64)
    json_in = fake_engine.post("/v1/pulls/run", json=_pull_body(), headers={"Accept": MSGPACK})
    assert _packed(json_in, 200, PullStatus).kv_bytes == 64


def test_a_get_feed_answers_msgpack_when_asked(fake_engine, fake):
    resp = fake_engine.get("/v1/pulls/finished?cursor=7", headers={"Accept": MSGPACK})
    assert _packed(resp, 200, dict) == {"pulls": [], "cursor": 7, "more": False}
    assert fake.calls == [("finished_pulls", (7, 1024))]


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xc1", msgspec.msgpack.encode(_hold())[:-1]],
    ids=["empty", "invalid-opcode", "truncated"],
)
def test_a_body_that_is_not_msgpack_is_a_400_naming_the_problem(fake_engine, fake, raw):
    err = _error(fake_engine.post("/v1/holds", content=raw, headers=BOTH), 400)
    assert err.error == "DecodeError" and err.detail.startswith("msgpack body: ")
    assert fake.calls == []


def test_a_json_body_labelled_msgpack_is_refused_not_guessed(fake_engine, fake):
    raw = msgspec.json.encode(_hold())  # "{" is the msgpack integer 123
    err = _error(fake_engine.post("/v1/holds", content=raw, headers=BOTH), 422)
    assert (err.error, err.detail) == ("ValidationError", "Expected `object`, got `int`")
    assert fake.calls == []


@pytest.mark.parametrize(
    ("body", "field", "detail"),
    [
        (_hold(block_ids=[[1, "x"]]), "block_ids[0][1]",
         "block_ids[0][1]: Expected `int`, got `str`"),
        (_hold(num_tokens=20.0), "num_tokens", "num_tokens: Expected `int`, got `float`"),
        (_hold(colour="red"), "colour", "colour: unknown field"),
        ({"block_ids": [], "num_tokens": 1}, "request_id", "request_id: missing required field"),
    ],
    ids=["wrong-type", "float-for-int", "unknown-field", "missing-field"],
)  # fmt: skip
def test_a_msgpack_body_of_the_wrong_shape_is_a_422_naming_the_field(fake_engine, body, field,
                                                                     detail):  # fmt: skip
    resp = fake_engine.post("/v1/holds", content=msgspec.msgpack.encode(body), headers=BOTH)
    assert _error(resp, 422) == ErrorBody(error="ValidationError", detail=detail, field=field)


def test_a_kvxferd_error_answers_its_status_and_field_in_msgpack(fake_engine, fake):
    fake.fail = errors.BlockIdError("block_ids[0][1]", "block 99 is outside the pool")
    resp = fake_engine.post("/v1/holds", content=msgspec.msgpack.encode(_hold()), headers=BOTH)
    err = _error(resp, 422)
    assert (err.error, err.field) == ("BlockIdError", "block_ids[0][1]")
    fake.fail = errors.AuthError("tickets[0].token: wrong MAC")
    resp = fake_engine.post("/v1/pulls/run", content=msgspec.msgpack.encode(_pull_body()),
                            headers=BOTH)  # fmt: skip
    assert _error(resp, 401).error == "AuthError"
    assert resp.headers["www-authenticate"] == "KVX1"


def test_routing_errors_and_not_registered_answer_in_msgpack_when_asked(fake_engine, fake):
    assert _error(fake_engine.get("/v1/nothing", headers={"Accept": MSGPACK}), 404).error == (
        "NotFound"
    )
    assert _error(fake_engine.get("/v1/holds", headers={"Accept": MSGPACK}), 405).error == (
        "MethodNotAllowed"
    )
    fake.ready = False
    resp = fake_engine.post("/v1/holds", content=msgspec.msgpack.encode(_hold()), headers=BOTH)
    assert _error(resp, 503).error == "NotRegisteredError"


def test_the_peer_api_speaks_json_only(fake_peer, fake):
    raw = msgspec.msgpack.encode({"hold_ids": ["h"], "extend_s": 1.0})
    resp = post(fake_peer, "/v1/heartbeat", raw)  # signed, but not JSON
    assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
    assert fake.calls == []


# ------------------------------------------------------------------------------ a real Sidecar


def test_a_real_hold_abort_and_released_feed_in_msgpack(real):
    body = _hold(block_ids=[[4, 5]])
    ticket = _packed(real.engine.post("/v1/holds", content=msgspec.msgpack.encode(body),
                                      headers=BOTH), 200, Ticket)  # fmt: skip
    assert (ticket.request_id, ticket.block_ids) == (body["request_id"], [[4, 5]])
    assert ticket.engine_id == real.manifest.engine_id and len(ticket.token) == 64
    resp = real.engine.post("/v1/holds/abort",
                            content=msgspec.msgpack.encode({"hold_id": ticket.hold_id}),
                            headers=BOTH)  # fmt: skip
    assert resp.status_code == 204
    feed = _packed(real.engine.get("/v1/released", headers={"Accept": MSGPACK}), 200, dict)
    assert [h["reason"] for h in feed["holds"] if h["hold_id"] == ticket.hold_id] == ["aborted"]
    again = real.engine.post("/v1/holds/abort",
                             content=msgspec.msgpack.encode({"hold_id": ticket.hold_id}),
                             headers=BOTH)  # fmt: skip
    assert _error(again, 404).error == "UnknownHoldError"
