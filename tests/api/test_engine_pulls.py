"""The one-call pull (``POST /v1/pulls/run``) and the finished-pulls feed on the engine API."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.wire import ErrorBody, FinishedPulls, PullStatus, Ticket

TICKET = Ticket(engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]],
                num_tokens=1, expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9")  # fmt: skip


def _error(resp, status: int) -> ErrorBody:
    assert resp.status_code == status, resp.text
    return msgspec.json.decode(resp.content, type=ErrorBody)


def test_run_pull_reaches_the_sidecar_typed_and_answers_the_final_status(fake_engine, fake):
    body = msgspec.to_builtins({"tickets": [TICKET], "block_ids": [[3]], "request_id": "q"})
    resp = fake_engine.post("/v1/pulls/run", json=body)
    assert resp.status_code == 200, resp.text
    status = msgspec.json.decode(resp.content, type=PullStatus)
    assert (status.state, status.kv_bytes) == ("done", 64)
    [(name, req)] = fake.calls
    assert name == "run_pull" and req.request_id == "q" and req.tickets == [TICKET]


def test_the_finished_feed_is_its_own_route_not_a_pull_id(fake_engine, fake):
    resp = fake_engine.get("/v1/pulls/finished?cursor=7&limit=20")
    assert resp.status_code == 200, resp.text
    assert msgspec.json.decode(resp.content, type=FinishedPulls).cursor == 7
    assert fake.calls == [("finished_pulls", (7, 20))]


def test_the_finished_feed_defaults_to_the_start_and_a_page_of_1024(fake_engine, fake):
    fake_engine.get("/v1/pulls/finished")
    assert fake.calls == [("finished_pulls", (0, 1024))]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=0", "limit"),
        ("limit=4097", "limit"),
        ("cursor=-1", "cursor"),
        ("cursor=x", "cursor"),
    ],
)
def test_bad_feed_parameters_are_422_naming_them(fake_engine, fake, query, field):
    err = _error(fake_engine.get(f"/v1/pulls/finished?{query}"), 422)
    assert err.field == field
    assert fake.calls == []


def test_a_run_pull_without_tickets_is_a_422_naming_tickets(real):
    err = _error(real.engine.post("/v1/pulls/run", json={"tickets": [], "block_ids": [[1]]}), 422)
    assert err.field == "tickets"


def test_a_real_sidecars_feed_starts_empty_at_cursor_0(real):
    resp = real.engine.get("/v1/pulls/finished?cursor=0")
    assert resp.status_code == 200, resp.text
    feed = msgspec.json.decode(resp.content, type=FinishedPulls)
    assert (feed.pulls, feed.cursor, feed.more) == ([], 0, False)


def test_before_registration_run_and_feed_answer_503(fake_engine, fake):
    fake.ready = False
    assert _error(fake_engine.get("/v1/pulls/finished"), 503).error == "NotRegisteredError"
    body = msgspec.to_builtins({"tickets": [TICKET], "block_ids": [[3]]})
    assert _error(fake_engine.post("/v1/pulls/run", json=body), 503).error == "NotRegisteredError"


def test_a_run_pull_with_a_nan_deadline_is_a_422_not_an_unfinished_answer(real):
    from kvxferd.sidecar.tickets import sign_ticket
    from tests.sidecar.harness import TOKEN

    ticket = msgspec.to_builtins(sign_ticket(TICKET, TOKEN.encode()))
    body = {"tickets": [ticket], "block_ids": [[1]], "deadline_s": float("nan")}
    resp = real.engine.post("/v1/pulls/run", content=msgspec.msgpack.encode(body),
                            headers={"Content-Type": "application/msgpack"})  # fmt: skip
    assert _error(resp, 422).field == "deadline_s"


def test_a_run_pull_listing_more_ids_than_its_tokens_span_is_a_422_naming_the_group(real):
    # The ticket's one token spans one block: a million ids (even all -1) are refused.
    from kvxferd.sidecar.tickets import sign_ticket
    from tests.sidecar.harness import TOKEN

    ticket = msgspec.to_builtins(sign_ticket(TICKET, TOKEN.encode()))
    body = {"tickets": [ticket], "block_ids": [[-1] * 1_000_000], "num_tokens": 1}
    resp = real.engine.post("/v1/pulls/run", content=msgspec.msgpack.encode(body),
                            headers={"Content-Type": "application/msgpack"})  # fmt: skip
    err = _error(resp, 422)
    assert err.field == "block_ids[0]" and "at most 1" in err.detail


@pytest.mark.parametrize("engine_id", ["e\n", "e f", "", "e" * 129])
def test_a_ticket_naming_an_engine_id_no_sidecar_can_have_is_a_422_naming_it(
    fake_engine, fake, engine_id
):
    ticket = {**msgspec.to_builtins(TICKET), "engine_id": engine_id}
    resp = fake_engine.post("/v1/pulls/run", json={"tickets": [ticket], "block_ids": [[3]]})
    assert _error(resp, 422).field == "tickets[0].engine_id"
    assert fake.calls == []


@pytest.mark.parametrize("path", ["/v1/pulls", "/v1/pulls/run"])
@pytest.mark.parametrize("request_id", ["q\n", "q\rforged", "x" * 513])
def test_a_pull_whose_request_id_is_too_long_or_has_a_control_character_is_a_422_naming_it(
    fake_engine, fake, path, request_id
):
    body = {"tickets": [msgspec.to_builtins(TICKET)], "block_ids": [[3]], "request_id": request_id}
    assert _error(fake_engine.post(path, json=body), 422).field == "request_id"
    ticket = {**msgspec.to_builtins(TICKET), "request_id": request_id}
    resp = fake_engine.post(path, json={"tickets": [ticket], "block_ids": [[3]]})
    assert _error(resp, 422).field == "tickets[0].request_id"
    assert fake.calls == []


@pytest.mark.parametrize("path", ["/v1/pulls", "/v1/pulls/run"])
def test_a_pull_whose_tickets_name_two_requests_is_a_422_before_any_claim(real, path):
    # Both MACs are valid: only their agreement shows rank 1's ticket is another request's.
    from kvxferd.sidecar.tickets import sign_ticket
    from tests.sidecar.harness import TOKEN

    ranks = [msgspec.structs.replace(TICKET, tp_size=2, tp_rank=r) for r in range(2)]
    ranks[1] = msgspec.structs.replace(ranks[1], request_id="another", hold_id="h2")
    tickets = [msgspec.to_builtins(sign_ticket(t, TOKEN.encode())) for t in ranks]
    err = _error(real.engine.post(path, json={"tickets": tickets, "block_ids": [[1]]}), 422)
    assert err.field == "tickets[1].request_id"
    assert err.error == "BlockIdError"


def test_a_run_pull_whose_ticket_lists_an_id_past_int64_is_a_422_naming_it(real):
    # Its MAC is valid: the id was only refused when the plan converted it (failed, internal).
    from kvxferd.sidecar.tickets import sign_ticket
    from tests.sidecar.harness import TOKEN

    ticket = msgspec.structs.replace(TICKET, block_ids=[[1 << 63]])
    body = {"tickets": [msgspec.to_builtins(sign_ticket(ticket, TOKEN.encode()))],
            "block_ids": [[1]]}  # fmt: skip
    resp = real.engine.post("/v1/pulls/run", content=msgspec.msgpack.encode(body),
                            headers={"Content-Type": "application/msgpack"})  # fmt: skip
    assert _error(resp, 422).field == "tickets[0].block_ids[0][0]"
