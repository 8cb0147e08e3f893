"""The engine API over HTTP: typed decoding, errors as ErrorBody with the right status and field,
bounded long polls, and a daemon that keeps answering after anything goes wrong."""

from __future__ import annotations

import math
import os
import uuid

import msgspec
import pytest

from kvxferd import errors
from kvxferd.api.engine import MAX_WAIT_S, engine_document
from kvxferd.memory import SHM_DIR
from kvxferd.wire import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_LAYERS,
    MAX_REGIONS,
    MAX_TICKETS_PER_CALL,
    MAX_TOKENS,
    MODEL_MAX_LENGTH,
    NAME_MAX_LENGTH,
    AbortHoldRequest,
    DeclineRequest,
    HeartbeatResponse,
    KeepaliveRequest,
    PullAccepted,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    Ticket,
)
from tests.api.conftest import JSON
from tests.api.engine_calls import error_of, hold_body
from tests.sidecar.harness import plan

# ------------------------------------------------------------------------------ decoding


def test_a_body_that_is_not_json_is_a_400_decodeerror_of(fake_engine, fake):
    body = error_of(fake_engine.post("/v1/holds", content=b"{not json", headers=JSON), 400)
    assert body.error == "DecodeError" and body.field == ""
    assert fake.calls == []


def test_an_empty_body_is_a_400(fake_engine):
    assert error_of(fake_engine.post("/v1/holds/abort", content=b""), 400).error == "DecodeError"


def test_a_wrong_type_is_a_422_naming_the_element_path(fake_engine, fake):
    resp = fake_engine.post("/v1/holds", json=hold_body(block_ids=[[1, "x"]]))
    body = error_of(resp, 422)
    assert (body.error, body.field) == ("ValidationError", "block_ids[0][1]")
    assert body.detail == "block_ids[0][1]: Expected `int`, got `str`"
    assert fake.calls == []


def test_a_wrong_type_deep_in_the_manifest_is_named_by_its_full_path(fake_engine):
    manifest = plan("llama-3.1-8b", num_blocks=4)
    body = msgspec.to_builtins(RegisterRequest(manifest=manifest, regions=[]))
    body["manifest"]["regions"][0]["size_bytes"] = "big"
    err = error_of(fake_engine.post("/v1/register", json=body), 422)
    assert err.field == "manifest.regions[0].size_bytes"


@pytest.mark.parametrize(
    ("where", "field"),
    [(None, "colour"), ("manifest.regions[0]", "manifest.regions[0].colour")],
    ids=["top-level", "nested"],
)
def test_an_unknown_field_is_rejected_and_named(fake_engine, where, field):
    manifest = plan("llama-3.1-8b", num_blocks=4)
    body = msgspec.to_builtins(RegisterRequest(manifest=manifest, regions=[]))
    target = body if where is None else body["manifest"]["regions"][0]
    target["colour"] = "blue"
    err = error_of(fake_engine.post("/v1/register", json=body), 422)
    assert (err.field, err.detail) == (field, f"{field}: unknown field")


def test_a_missing_field_is_named(fake_engine):
    body = hold_body()
    del body["request_id"]
    err = error_of(fake_engine.post("/v1/holds", json=body), 422)
    assert (err.field, err.detail) == ("request_id", "request_id: missing required field")


def test_a_body_of_the_wrong_json_kind_is_a_422_without_a_field(fake_engine):
    err = error_of(fake_engine.post("/v1/holds", json=[1, 2]), 422)
    assert err.field == "" and "Expected `object`" in err.detail


def test_a_well_typed_body_reaches_the_sidecar_as_its_struct(fake_engine, fake):
    assert fake_engine.post("/v1/holds/abort", json={"hold_id": "h1"}).status_code == 204
    assert fake.calls == [("abort", AbortHoldRequest(hold_id="h1"))]


def test_a_keepalive_reaches_the_sidecar_typed_and_answers_heartbeats(fake_engine, fake):
    ticket = Ticket(engine_id="e", epoch=1, hold_id="h9", request_id="r", block_ids=[[1]],
                    num_tokens=1, expires_at=0.0, tp_rank=0, tp_size=1,
                    peer="127.0.0.1:9")  # fmt: skip
    body = msgspec.to_builtins({"tickets": [ticket], "extend_s": 12.5})
    resp = fake_engine.post("/v1/keepalive", json=body)
    assert resp.status_code == 200
    answer = msgspec.json.decode(resp.content, type=HeartbeatResponse)
    assert (answer.extended, answer.missing, answer.unanswered) == (["h9"], [], [])
    assert fake.calls == [("keepalive", KeepaliveRequest(tickets=[ticket], extend_s=12.5))]
    err = error_of(fake_engine.post("/v1/keepalive", json={"tickets": [], "extend_s": "long"}), 422)
    assert err.field == "extend_s"


# ------------------------------------------------------------------------------ error mapping


@pytest.mark.parametrize(
    ("exc", "status", "field"),
    [
        (errors.BlockIdError("block_ids[0][3]", "block id 99 outside [0, 8)"), 422,
         "block_ids[0][3]"),
        (errors.HoldRequestError("lease_s", "must be > 0"), 422, "lease_s"),
        (errors.ManifestError("regions[1].size_bytes", "too small"), 422, "regions[1].size_bytes"),
        (errors.DuplicateHoldError("request_id", "already held"), 409, "request_id"),
        (errors.UnknownHoldError("hold_id 'h': no such hold"), 404, ""),
        (errors.HoldExpiredError("hold_id 'h': lease ended"), 410, ""),
        (errors.IncompatiblePeerError({"groups[0].kind": ("mamba", "full_attention"),
                                       "num_blocks": (8, 4)}), 409, "groups[0].kind,num_blocks"),
        (errors.AuthError("ticket.token: missing"), 401, ""),
        (errors.AlreadyRegisteredError("register: this sidecar already has an engine"), 409, ""),
        (errors.NotRegisteredError("no engine has registered with this sidecar yet"), 503, ""),
        (errors.UnknownPullError("no pull 'p' on this sidecar"), 404, ""),
        (errors.ConfigError("default_lease_s: larger than max_lease_s"), 500, ""),
        (errors.MemoryRegionError("no such segment"), 422, ""),
        (errors.RegistrationError("ucx said no"), 502, ""),
        (errors.StateError("done", "pending", "backward"), 409, ""),
        (errors.PullError("hold_expired", "too late"), 502, ""),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None,
)  # fmt: skip
def test_kvxferd_errors_answer_their_status_class_and_field(fake_engine, fake, exc, status, field):
    fake.fail = exc
    body = error_of(fake_engine.post("/v1/holds", json=hold_body()), status)
    assert (body.error, body.field) == (type(exc).__name__, field)
    assert body.detail == str(exc)


def test_a_401_says_how_to_authenticate(fake_engine, fake):
    fake.fail = errors.AuthError("ticket.token: missing")
    resp = fake_engine.post("/v1/holds", json=hold_body())
    assert error_of(resp, 401).error == "AuthError"
    assert resp.headers["www-authenticate"] == "KVX1"


def test_an_unexpected_exception_is_a_500_and_the_app_keeps_answering(fake_engine, fake, caplog):
    fake.fail = ZeroDivisionError("bug")
    body = error_of(fake_engine.post("/v1/holds", json=hold_body()), 500)
    assert body.error == "InternalError" and "ZeroDivisionError: bug" in body.detail
    assert "failed unexpectedly" in caplog.text
    fake.fail = None
    assert fake_engine.get("/healthz").json() == {"status": "ok"}
    assert fake_engine.post("/v1/holds/abort", json={"hold_id": "h"}).status_code == 204


def test_before_registration_engine_calls_answer_503_not_registered(fake_engine, fake):
    fake.ready = False
    for method, path, body in [
        ("POST", "/v1/holds", hold_body()),
        ("POST", "/v1/holds/abort", {"hold_id": "h"}),
        ("POST", "/v1/pulls", {"tickets": [], "block_ids": []}),
        ("GET", "/v1/released", None),
    ]:
        resp = fake_engine.request(method, path, json=body)
        assert error_of(resp, 503).error == "NotRegisteredError", path
    assert fake.calls == []
    assert fake_engine.get("/healthz").status_code == 200


def test_an_unknown_path_and_a_wrong_method_answer_an_error_body(fake_engine):
    assert error_of(fake_engine.get("/v2/holds"), 404).error == "NotFound"
    resp = fake_engine.get("/v1/holds")
    assert error_of(resp, 405).error == "MethodNotAllowed"
    assert resp.headers["allow"] == "POST"


# ------------------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    ("query", "passed"),
    [("", 0.0), ("?wait=2.5", 2.5), (f"?wait={MAX_WAIT_S * 100:g}", MAX_WAIT_S),
     ("?wait=inf", MAX_WAIT_S)],
    ids=["default", "short", "too-long", "infinite"],
)  # fmt: skip
def test_a_pull_status_long_poll_is_cut_to_max_wait(fake_engine, fake, query, passed):
    resp = fake_engine.get(f"/v1/pulls/p7{query}")
    assert msgspec.json.decode(resp.content, type=PullStatus).pull_id == "p7"
    assert fake.calls == [("pull_status", ("p7", passed))]
    assert math.isfinite(passed) and passed <= MAX_WAIT_S


@pytest.mark.parametrize("wait", ["-1", "soon", "nan"])
def test_a_bad_wait_is_a_422_naming_it(fake_engine, fake, wait):
    err = error_of(fake_engine.get(f"/v1/pulls/p7?wait={wait}"), 422)
    assert err.field == "wait"
    assert fake.calls == []


def test_the_released_cursor_is_typed(fake_engine, fake):
    assert fake_engine.get("/v1/released?cursor=5").json() == {
        "holds": [],
        "cursor": 5,
        "more": False,
    }
    assert error_of(fake_engine.get("/v1/released?cursor=five"), 422).field == "cursor"
    assert error_of(fake_engine.get("/v1/released?cursor=-1"), 422).field == "cursor"
    assert fake.calls == [("released_since", (5, 1024))]


def test_the_released_feed_is_paged_by_a_typed_limit(fake_engine, fake):
    assert fake_engine.get("/v1/released?cursor=2&limit=10").status_code == 200
    for bad in ("0", "4097", "many"):
        assert error_of(fake_engine.get(f"/v1/released?limit={bad}"), 422).field == "limit"
    assert fake.calls == [("released_since", (2, 10))]


def test_a_decline_reaches_the_sidecar_typed(fake_engine, fake):
    body = {"tickets": [], "reason": "rejected"}
    assert fake_engine.post("/v1/decline", json=body).status_code == 200
    assert error_of(fake_engine.post("/v1/decline", json={"tickets": 3}), 422).field == "tickets"
    [(name, req)] = fake.calls
    assert name == "decline" and isinstance(req, DeclineRequest) and req.reason == "rejected"


@pytest.mark.parametrize("route", ["/v1/decline", "/v1/keepalive"])
def test_a_decline_or_keepalive_past_max_tickets_per_call_is_a_422_naming_tickets(
    fake_engine, fake, route
):
    ticket = msgspec.to_builtins(Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9"))  # fmt: skip
    body = {"tickets": [ticket] * (MAX_TICKETS_PER_CALL + 1), "extend_s": 1.0}
    if route == "/v1/decline":
        del body["extend_s"]
    err = error_of(fake_engine.post(route, json=body), 422)
    assert (err.error, err.field) == ("ValidationError", "tickets")
    assert fake.calls == []  # the sidecar never sees it, and keeps serving
    body["tickets"] = body["tickets"][:MAX_TICKETS_PER_CALL]
    assert fake_engine.post(route, json=body).status_code == 200


_FLOOD = msgspec.Raw(b"\xdd" + (MAX_BLOCK_IDS + 1).to_bytes(4, "big") + bytes(MAX_BLOCK_IDS + 1))
"""A msgpack list of MAX_BLOCK_IDS + 1 ids (one group's)."""


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [("/v1/pulls", {"tickets": [{"block_ids": [[1], _FLOOD]}], "block_ids": [[1], [2]]},
      "tickets[0].block_ids[1]"),
     ("/v1/pulls", {"tickets": [{}], "block_ids": [[1], _FLOOD]}, "block_ids[1]"),
     ("/v1/decline", {"tickets": [{}, {"block_ids": [[1], _FLOOD]}]}, "tickets[1].block_ids[1]"),
     ("/v1/holds", {"request_id": "r", "block_ids": [[1], _FLOOD], "num_tokens": 1},
      "block_ids[1]"),
     ("/v1/store/load", {"keys": [], "block_ids": [[1], _FLOOD], "num_tokens": 0},
      "block_ids[1]")],
    ids=["ticket", "pull", "decline", "hold", "store-load"],
)  # fmt: skip
def test_a_group_of_more_than_max_block_ids_is_a_422_naming_it_before_the_sidecar(
    fake_engine, fake, route, body, field
):
    ticket = msgspec.to_builtins(Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1], [2]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9"))  # fmt: skip
    if "tickets" in body:
        body = {**body, "tickets": [{**ticket, **t} for t in body["tickets"]]}
    resp = fake_engine.post(route, content=msgspec.msgpack.encode(body),
                            headers={"Content-Type": "application/msgpack"})  # fmt: skip
    err = error_of(resp, 422)
    assert (err.error, err.field) == ("ValidationError", field)
    assert fake.calls == []  # the sidecar never sees it, and keeps serving
    assert fake_engine.post("/v1/decline", json={"tickets": [ticket]}).status_code == 200


_PLANNED = msgspec.to_builtins(plan("llama-3.1-8b"))
_GROUPS = [[1]] * (MAX_GROUPS + 1)


def _manifest_with(key: str, n: int) -> dict:
    """The planned manifest with ``n`` copies of its first region or group, or of group 0's
    first layer (``layers``)."""
    if key == "layers":
        group = _PLANNED["groups"][0]
        return {**_PLANNED, "groups": [{**group, "layers": group["layers"][:1] * n}]}
    return {**_PLANNED, key: _PLANNED[key][:1] * n}


def _manifest_naming(what: str, name: str) -> dict:
    """The planned manifest with ``name`` as its model, its first region's or first layer's."""
    if what == "model":
        return {**_PLANNED, "model": name}
    if what == "region":
        return {**_PLANNED, "regions": [{**_PLANNED["regions"][0], "name": name}]}
    group = _PLANNED["groups"][0]
    layers = [{**group["layers"][0], "name": name}]
    return {**_PLANNED, "groups": [{**group, "layers": layers}]}


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [("/v1/register", {"manifest": _manifest_with("groups", MAX_GROUPS + 1), "regions": []},
      "manifest.groups"),
     ("/v1/register", {"manifest": _manifest_with("regions", MAX_REGIONS + 1), "regions": []},
      "manifest.regions"),
     ("/v1/register", {"manifest": _manifest_with("layers", MAX_LAYERS + 1), "regions": []},
      "manifest.groups[0].layers"),
     ("/v1/register", {"manifest": _manifest_naming("model", "m" * (MODEL_MAX_LENGTH + 1)),
                       "regions": []}, "manifest.model"),
     ("/v1/register", {"manifest": _manifest_naming("region", "r" * (NAME_MAX_LENGTH + 1)),
                       "regions": []}, "manifest.regions[0].name"),
     ("/v1/register", {"manifest": _manifest_naming("layer", "l" * (NAME_MAX_LENGTH + 1)),
                       "regions": []}, "manifest.groups[0].layers[0].name"),
     ("/v1/holds", hold_body(block_ids=_GROUPS), "block_ids"),
     ("/v1/pulls", {"tickets": [], "block_ids": _GROUPS}, "block_ids"),
     ("/v1/store/save", {"request_id": "r", "keys": [], "block_ids": _GROUPS}, "block_ids"),
     ("/v1/store/load", {"keys": [], "block_ids": _GROUPS, "num_tokens": 0}, "block_ids")],
    ids=["groups", "regions", "layers", "model-name", "region-name", "layer-name", "hold", "pull",
         "store-save", "store-load"],
)  # fmt: skip
@pytest.mark.parametrize("wire", ["json", "msgpack"])
def test_a_list_past_its_bound_is_a_422_naming_it_before_the_sidecar(
    fake_engine, fake, route, body, field, wire
):
    encode = msgspec.json.encode if wire == "json" else msgspec.msgpack.encode
    resp = fake_engine.post(route, content=encode(body),
                            headers={"Content-Type": f"application/{wire}"})  # fmt: skip
    err = error_of(resp, 422)
    assert (err.error, err.field) == ("ValidationError", field)
    assert fake.calls == []  # the sidecar never sees it, and keeps serving
    assert fake_engine.post("/v1/decline", json={"tickets": []}).status_code == 200


@pytest.mark.parametrize("reason", ["rejected\nkvxferd ready", "rejected\n", "x" * 257])
def test_a_decline_whose_reason_is_not_one_short_line_is_a_422_naming_it(fake_engine, fake, reason):
    err = error_of(fake_engine.post("/v1/decline", json={"tickets": [], "reason": reason}), 422)
    assert err.field == "reason"
    assert fake.calls == []


def test_a_pull_is_accepted_with_202_and_its_id(fake_engine):
    ticket = Ticket(
        engine_id="e",
        epoch=1,
        hold_id="h",
        request_id="r",
        block_ids=[[1]],
        num_tokens=1,
        expires_at=0.0,
        tp_rank=0,
        tp_size=1,
        peer="127.0.0.1:9",
    )
    body = msgspec.to_builtins({"tickets": [ticket], "block_ids": [[3]]})
    resp = fake_engine.post("/v1/pulls", json=body)
    assert resp.status_code == 202
    assert msgspec.json.decode(resp.content, type=PullAccepted).pull_id == "p1"


def test_the_served_openapi_document_is_the_generated_one(fake_engine):
    assert fake_engine.get("/openapi.json").json() == engine_document()


# ------------------------------------------------------------------------------ a real Sidecar


def test_a_registered_sidecar_answers_with_its_identity_and_refuses_a_second_engine(real):
    assert real.manifest.engine_id == "api-test" and real.sidecar.ready
    body = RegisterRequest(manifest=plan("llama-3.1-8b", num_blocks=8), regions=real.pool.specs())
    err = error_of(real.engine.post("/v1/register", content=msgspec.json.encode(body)), 409)
    assert err.error == "AlreadyRegisteredError" and "already has an engine" in err.detail


@pytest.mark.parametrize(
    ("mutate", "status", "error", "field"),
    [
        (lambda specs: specs[:1], 422, "ManifestError", "regions"),
        (lambda specs: [msgspec.structs.replace(specs[0], size_bytes=64), *specs[1:]], 422,
         "ManifestError", "regions[0].size_bytes"),
        (lambda specs: [msgspec.structs.replace(specs[0], name="kvx-no-such-segment"),
                        *specs[1:]], 422, "MemoryRegionError", ""),
    ],
    ids=["region-count", "region-too-small", "no-such-segment"],
)  # fmt: skip
def test_register_checks_the_region_sources_against_the_manifest(fresh, mutate, status, error,
                                                                 field):  # fmt: skip
    body = RegisterRequest(manifest=fresh.manifest, regions=mutate(fresh.pool.specs()))
    err = error_of(fresh.engine.post("/v1/register", content=msgspec.json.encode(body)), status)
    assert (err.error, err.field) == (error, field)
    assert not fresh.sidecar.ready
    good = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    resp = fresh.engine.post("/v1/register", content=msgspec.json.encode(good))
    assert resp.status_code == 200, resp.text
    answer = msgspec.json.decode(resp.content, type=RegisterResponse)
    assert (answer.engine_id, answer.epoch) == (fresh.sidecar.engine_id, fresh.sidecar.epoch)


def test_register_refuses_a_segment_smaller_than_its_region_naming_the_field(fresh):
    os.truncate(os.path.join(SHM_DIR, fresh.pool.specs()[0].name), 4096)  # the engine's doing
    body = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    err = error_of(fresh.engine.post("/v1/register", content=msgspec.json.encode(body)), 422)
    assert (err.error, err.field) == ("SegmentTooSmallError", "regions[0].size_bytes")
    assert "has 4096 bytes" in err.detail
    assert not fresh.sidecar.ready


@pytest.mark.parametrize("path", ["/v1/store/save", "/v1/store/load"])
def test_a_store_call_with_a_newline_in_its_request_id_is_a_422_naming_it(fake_engine, fake, path):
    body = {"request_id": "r\n", "keys": ["0" * 32], "block_ids": [[1]], "num_tokens": 16}
    assert error_of(fake_engine.post(path, json=body), 422).field == "request_id"
    assert fake.calls == []


def test_the_status_of_an_unknown_pull_is_a_404_unknown_pullerror_of(real):
    err = error_of(real.engine.get("/v1/pulls/nope?wait=0"), 404)
    assert err.error == "UnknownPullError" and "'nope'" in err.detail


def test_a_pull_without_tickets_is_a_422_naming_tickets(real):
    err = error_of(real.engine.post("/v1/pulls", json={"tickets": [], "block_ids": [[1]]}), 422)
    assert (err.error, err.field) == ("BlockIdError", "tickets")


@pytest.mark.parametrize("route", ["/v1/pulls", "/v1/keepalive", "/v1/decline"])
def test_a_ticket_with_a_wrong_mac_is_a_401_naming_it_before_any_call(real, route):
    good = msgspec.json.decode(real.engine.post("/v1/holds", json={
        "request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[3]], "num_tokens": 8}).content,
        type=Ticket)  # fmt: skip
    bad = msgspec.structs.replace(good, peer="127.0.0.1:1")  # points elsewhere, MAC unchanged
    tickets = msgspec.to_builtins([good, bad])
    body = {"/v1/pulls": {"tickets": tickets, "block_ids": [[4]]},
            "/v1/keepalive": {"tickets": tickets, "extend_s": 5.0},
            "/v1/decline": {"tickets": tickets}}[route]  # fmt: skip
    err = error_of(real.engine.post(route, json=body), 401)
    assert (err.error, err.field) == ("AuthError", "tickets[1].token")
    assert real.engine.post("/v1/holds/abort", json={"hold_id": good.hold_id}).status_code == 204


@pytest.mark.parametrize(
    ("change", "field"),
    [({"peer": "h\r\nX-Forged: 1:1"}, "tickets[0].peer"),
     ({"peer": "h" * 256 + ":1"}, "tickets[0].peer"),
     ({"token": "0" * 65}, "tickets[0].token"),
     ({"num_tokens": MAX_TOKENS + 1}, "tickets[0].num_tokens")],
    ids=["peer-header-injection", "peer-too-long", "token-too-long", "tokens-past-max"],
)  # fmt: skip
def test_a_ticket_whose_peer_token_or_tokens_are_malformed_is_a_422_naming_it(real, change, field):
    good = msgspec.json.decode(real.engine.post("/v1/holds", json=hold_body(block_ids=[[5]]))
                               .content, type=Ticket)  # fmt: skip
    ticket = {**msgspec.to_builtins(good), **change}
    err = error_of(real.engine.post("/v1/pulls", json={"tickets": [ticket], "block_ids": [[6]]}),
                 422)  # fmt: skip
    assert (err.error, err.field) == ("ValidationError", field)
    assert real.engine.post("/v1/holds/abort", json={"hold_id": good.hold_id}).status_code == 204


def test_before_registration_the_sidecar_itself_raises_not_registered(fresh):
    with pytest.raises(errors.NotRegisteredError, match="no engine has registered"):
        fresh.sidecar.released_since(0)
    with pytest.raises(errors.NotRegisteredError):
        fresh.sidecar.abort(AbortHoldRequest(hold_id="h"))
    assert error_of(fresh.engine.get("/v1/released"), 503).error == "NotRegisteredError"
