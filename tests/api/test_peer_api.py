"""The peer API over HTTP: bearer auth before anything else, probes and metrics without a token,
handshake compatibility as 409 naming the fields, claims that never hand out a dead hold."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from kvxferd.api.peer import peer_document
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    PROTOCOL_VERSION,
    ClaimResponse,
    ErrorBody,
    Handshake,
    HeartbeatResponse,
    Ticket,
)
from tests.api.conftest import AUTH
from tests.sidecar.harness import TOKEN, plan, wait_until

V1 = ["/v1/handshake", "/v1/claims", "/v1/heartbeat"]


def _error(resp, status: int) -> ErrorBody:
    assert resp.status_code == status, resp.text
    return msgspec.json.decode(resp.content, type=ErrorBody)


def _hold(real, lease_s: float | None = None) -> Ticket:
    body = {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[5]], "num_tokens": 16,
            "lease_s": lease_s}  # fmt: skip
    resp = real.engine.post("/v1/holds", json=body)
    assert resp.status_code == 200, resp.text
    return msgspec.json.decode(resp.content, type=Ticket)


def _claim(real, ticket: Ticket, headers=AUTH):
    body = {"ticket": msgspec.to_builtins(ticket), "reader": "reader-agent",
            "reader_tp_size": 1, "claim_s": 5.0}  # fmt: skip
    return real.peer.post("/v1/claims", json=body, headers=headers)


def _handshake(real, **changes) -> dict:
    hs = Handshake(protocol_version=PROTOCOL_VERSION, engine_id="other", epoch=1,
                   agent_name="other-agent", agent_metadata=b"\x00", manifest=real.manifest,
                   region_bases=[0] * len(real.manifest.regions))  # fmt: skip
    return {**msgspec.to_builtins(hs), **changes}


# ------------------------------------------------------------------------------ auth


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
     {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer "}],
    ids=["none", "wrong", "no-scheme", "basic", "empty"],
)  # fmt: skip
@pytest.mark.parametrize("path", V1)
def test_v1_calls_without_the_right_bearer_token_are_401(fake_peer, fake, path, headers):
    resp = fake_peer.post(path, content=b"not even json", headers=headers)
    assert _error(resp, 401).error == "AuthError"  # checked before the body is looked at
    assert resp.headers["www-authenticate"] == "Bearer"
    assert fake.calls == []


def test_the_bearer_scheme_is_case_insensitive(fake_peer, fake):
    resp = fake_peer.post("/v1/heartbeat", json={"hold_ids": [], "extend_s": 1.0},
                          headers={"Authorization": f"bearer {TOKEN}"})  # fmt: skip
    assert resp.status_code != 401
    assert [name for name, _ in fake.calls] == ["heartbeat"]


def test_an_empty_configured_token_admits_nobody(fake):
    from fastapi.testclient import TestClient

    from kvxferd.api.peer import peer_app

    fake.config.peer_token = ""
    with TestClient(peer_app(fake), raise_server_exceptions=False) as client:
        resp = client.post("/v1/heartbeat", json={}, headers={"Authorization": "Bearer "})
        assert resp.status_code == 401


def test_probes_metrics_and_the_document_need_no_token(fake_peer):
    assert fake_peer.get("/healthz").json() == {"status": "ok"}
    assert fake_peer.get("/readyz").json() == {"ready": True}
    metrics = fake_peer.get("/metrics")
    assert metrics.status_code == 200 and "kvxferd_" in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    assert fake_peer.get("/openapi.json").json() == peer_document()


def test_readyz_is_503_with_an_error_body_until_an_engine_registers(fake_peer, fake):
    fake.ready = False
    assert _error(fake_peer.get("/readyz"), 503).error == "NotRegisteredError"
    resp = fake_peer.post("/v1/heartbeat", json={}, headers=AUTH)
    assert _error(resp, 503).error == "NotRegisteredError"
    fake.ready = True
    assert fake_peer.get("/readyz").status_code == 200


def test_a_bad_peer_body_is_a_422_naming_the_field(fake_peer):
    resp = fake_peer.post("/v1/heartbeat", json={"hold_ids": [1], "extend_s": 1.0}, headers=AUTH)
    err = _error(resp, 422)
    assert err.field == "hold_ids[0]" and err.detail.startswith("hold_ids[0]: ")


def test_an_unexpected_exception_is_a_500_and_the_peer_app_keeps_answering(fake_peer, fake):
    fake.fail = KeyError("oops")
    resp = fake_peer.post("/v1/heartbeat", json={"hold_ids": [], "extend_s": 1.0}, headers=AUTH)
    assert _error(resp, 500).error == "InternalError"
    assert fake_peer.get("/healthz").status_code == 200


# ------------------------------------------------------------------------------ a real Sidecar


def test_a_compatible_handshake_answers_with_our_identity_and_agent(real):
    resp = real.peer.post("/v1/handshake", json=_handshake(real), headers=AUTH)
    assert resp.status_code == 200, resp.text
    ours = msgspec.json.decode(resp.content, type=Handshake)
    assert (ours.engine_id, ours.epoch, ours.agent_name) == (
        "api-test", real.sidecar.epoch, real.sidecar.agent.name)  # fmt: skip
    assert ours.manifest == real.manifest and len(ours.region_bases) == len(ours.manifest.regions)


def test_a_handshake_tolerates_fields_from_a_newer_peer(real):
    body = _handshake(real, compression="zstd")
    assert real.peer.post("/v1/handshake", json=body, headers=AUTH).status_code == 200


def test_an_incompatible_manifest_is_a_409_naming_every_disagreeing_field(real):
    other = plan("qwen3-8b", num_blocks=4)
    resp = real.peer.post(
        "/v1/handshake", json=_handshake(real, manifest=msgspec.to_builtins(other)), headers=AUTH
    )
    err = _error(resp, 409)
    assert err.error == "IncompatiblePeerError"
    fields = err.field.split(",")
    assert "groups[0].layers" in fields
    assert all(f in err.detail for f in fields)


def test_a_different_protocol_version_is_a_409_naming_it(real):
    body = _handshake(real, protocol_version=PROTOCOL_VERSION + 1)
    err = _error(real.peer.post("/v1/handshake", json=body, headers=AUTH), 409)
    assert err.field == "protocol_version"


def test_a_claim_pins_a_live_hold_for_its_readers(real):
    ticket = _hold(real)
    resp = _claim(real, ticket)
    assert resp.status_code == 200, resp.text
    claim = msgspec.json.decode(resp.content, type=ClaimResponse)
    assert claim.hold_id == ticket.hold_id and claim.expected_readers == 1


def test_a_tampered_ticket_is_a_401(real):
    ticket = msgspec.structs.replace(_hold(real), block_ids=[[6]])
    err = _error(_claim(real, ticket), 401)
    assert err.error == "AuthError" and "ticket.token" in err.detail


def test_a_claim_of_an_unknown_hold_is_a_404(real):
    ticket = sign_ticket(msgspec.structs.replace(_hold(real), hold_id="nope"), TOKEN.encode())
    assert _error(_claim(real, ticket), 404).error == "UnknownHoldError"


def test_a_claim_of_an_expired_hold_is_a_410_and_never_succeeds_later(real):
    ticket = _hold(real, lease_s=0.05)
    wait_until(lambda: time.time() > ticket.expires_at, 10.0, "the hold's lease to end")
    assert _error(_claim(real, ticket), 410).error == "HoldExpiredError"
    assert _claim(real, ticket).status_code in (404, 410)


def test_a_heartbeat_extends_live_holds_and_reports_missing_ones(real):
    ticket = _hold(real)
    body = {"hold_ids": [ticket.hold_id, "gone"], "extend_s": 5.0}
    resp = real.peer.post("/v1/heartbeat", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    beat = msgspec.json.decode(resp.content, type=HeartbeatResponse)
    assert (beat.extended, beat.missing) == ([ticket.hold_id], ["gone"])


def test_an_app_whose_operations_need_a_token_cannot_be_built_without_a_check(fake):
    from fastapi import FastAPI

    from kvxferd.api.operations import Gate, mount
    from kvxferd.api.peer import OPERATIONS

    with pytest.raises(ValueError, match="authorize"):
        mount(FastAPI(), OPERATIONS, fake, Gate())
