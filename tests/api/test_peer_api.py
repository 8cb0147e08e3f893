"""The peer API over HTTP: signed requests checked before anything else (replays, stale, tampered
and foreign ones refused; two keys during a rollover), probes and metrics without a signature,
handshake compatibility as 409 naming the fields, claims that bind to their hold and never hand
out a dead one, declines."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest

from kvxferd.api.peer import peer_document
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    MAX_GROUPS,
    MAX_REGIONS,
    MAX_TICKETS_PER_CALL,
    PROTOCOL_VERSION,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    ErrorBody,
    Handshake,
    HeartbeatResponse,
    Ticket,
)
from tests.api.conftest import post, signed
from tests.sidecar.harness import TOKEN, plan, wait_until

V1 = ["/v1/handshake", "/v1/claims", "/v1/heartbeat", "/v1/decline"]


def _error(resp, status: int) -> ErrorBody:
    assert resp.status_code == status, resp.text
    return msgspec.json.decode(resp.content, type=ErrorBody)


def _hold(real, lease_s: float | None = None) -> Ticket:
    body = {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[5]], "num_tokens": 16,
            "lease_s": lease_s}  # fmt: skip
    resp = real.engine.post("/v1/holds", json=body)
    assert resp.status_code == 200, resp.text
    return msgspec.json.decode(resp.content, type=Ticket)


def _claim(real, ticket: Ticket, reader: str = "reader-agent", reader_tp_size: int = 1):
    body = {"ticket": msgspec.to_builtins(ticket), "reader": reader,
            "reader_tp_size": reader_tp_size, "claim_s": 5.0}  # fmt: skip
    return post(real.peer, "/v1/claims", body)


def _handshake(real, **changes) -> dict:
    hs = Handshake(protocol_version=PROTOCOL_VERSION, engine_id="other", epoch=1,
                   agent_name="other-agent", agent_metadata=b"\x00", manifest=real.manifest,
                   region_bases=[0] * len(real.manifest.regions))  # fmt: skip
    return {**msgspec.to_builtins(hs), **changes}


# ------------------------------------------------------------------------------ auth

BODY = b'{"hold_ids": [], "extend_s": 1.0}'


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": TOKEN},
     {"Authorization": "KVX1 key=00, ts=1, nonce=00, sig=00"},
     {"Authorization": "KVX1 "}],
    ids=["none", "bearer-secret", "no-scheme", "malformed", "empty"],
)  # fmt: skip
@pytest.mark.parametrize("path", V1)
def test_v1_calls_without_a_valid_signature_are_401(fake_peer, fake, path, headers):
    resp = fake_peer.post(path, content=b"not even json", headers=headers)
    assert _error(resp, 401).error == "AuthError"  # checked before the body is decoded
    assert resp.headers["www-authenticate"] == "KVX1"
    assert fake.calls == []


def test_a_signed_call_is_admitted_and_its_scheme_is_case_insensitive(fake_peer, fake):
    assert post(fake_peer, "/v1/heartbeat", BODY).status_code != 401
    headers = signed("POST", "/v1/heartbeat", BODY)
    headers["Authorization"] = headers["Authorization"].replace("KVX1", "kvx1", 1)
    assert fake_peer.post("/v1/heartbeat", content=BODY, headers=headers).status_code != 401
    assert [name for name, _ in fake.calls] == ["heartbeat", "heartbeat"]


def test_a_replayed_request_is_401(fake_peer, fake):
    headers = signed("POST", "/v1/heartbeat", BODY)
    assert fake_peer.post("/v1/heartbeat", content=BODY, headers=headers).status_code != 401
    again = fake_peer.post("/v1/heartbeat", content=BODY, headers=headers)
    assert "replayed" in _error(again, 401).detail
    assert len(fake.calls) == 1


@pytest.mark.parametrize("offset", [-31, 31, -3600], ids=["late", "early", "hour-old"])
def test_a_request_outside_the_replay_window_is_401(fake_peer, fake, offset):
    resp = post(fake_peer, "/v1/heartbeat", BODY, now=time.time() + offset)
    assert "window" in _error(resp, 401).detail and fake.calls == []


def test_a_request_whose_body_path_or_signature_was_changed_is_401(fake_peer, fake):
    headers = signed("POST", "/v1/heartbeat", BODY)
    tampered = BODY.replace(b"1.0", b"9.0")
    resp = fake_peer.post("/v1/heartbeat", content=tampered, headers=headers)
    assert "signature" in _error(resp, 401).detail
    headers = signed("POST", "/v1/heartbeat", BODY)
    resp = fake_peer.post("/v1/claims", content=BODY, headers=headers)  # signed for another path
    assert "signature" in _error(resp, 401).detail
    headers = signed("POST", "/v1/heartbeat", BODY)
    sig = headers["Authorization"][-64:]
    headers["Authorization"] = headers["Authorization"][:-64] + sig[::-1]
    assert _error(fake_peer.post("/v1/heartbeat", content=BODY, headers=headers), 401)
    assert fake.calls == []


def test_a_request_signed_with_another_secret_is_401(fake_peer, fake):
    resp = post(fake_peer, "/v1/heartbeat", BODY, keys=PeerKeys.of("another-secret"))
    assert "unknown key id" in _error(resp, 401).detail and fake.calls == []


def test_during_a_rollover_both_keys_are_accepted_whichever_side_moved_first(fake):
    from fastapi.testclient import TestClient

    from kvxferd.api.peer import peer_app

    old, new = PeerKeys.of(TOKEN), PeerKeys.of("the-next-secret")
    # Two sidecars mid-rollover: one signs with the old secret and accepts the new one, the
    # other signs with the new one and accepts the old one; each admits the other's calls.
    for mine, other in ((("the-next-secret", TOKEN), old), ((TOKEN, "the-next-secret"), new)):
        fake.config.peer_token, fake.config.peer_token_previous = mine
        with TestClient(peer_app(fake), raise_server_exceptions=False) as client:
            assert post(client, "/v1/heartbeat", BODY, keys=other).status_code == 200
            stale = post(client, "/v1/heartbeat", BODY, keys=PeerKeys.of("rotated-out"))
            assert stale.status_code == 401
    assert len(fake.calls) == 2


def test_an_empty_configured_token_admits_nobody(fake):
    from fastapi.testclient import TestClient

    from kvxferd.api.peer import peer_app

    fake.config.peer_token = ""
    with TestClient(peer_app(fake), raise_server_exceptions=False) as client:
        resp = post(client, "/v1/heartbeat", BODY)
        assert resp.status_code == 401 and fake.calls == []


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
    resp = post(fake_peer, "/v1/heartbeat", {})
    assert _error(resp, 503).error == "NotRegisteredError"
    fake.ready = True
    assert fake_peer.get("/readyz").status_code == 200


def test_a_bad_peer_body_is_a_422_naming_the_field(fake_peer):
    resp = post(fake_peer, "/v1/heartbeat", {"hold_ids": [1], "extend_s": 1.0})
    err = _error(resp, 422)
    assert err.field == "hold_ids[0]" and err.detail.startswith("hold_ids[0]: ")


@pytest.mark.parametrize(
    ("key", "most", "field"),
    [("groups", MAX_GROUPS, "manifest.groups"), ("regions", MAX_REGIONS, "manifest.regions"),
     ("region_bases", MAX_REGIONS, "region_bases")],
    ids=["groups", "regions", "region-bases"],
)  # fmt: skip
def test_a_handshake_listing_past_a_bound_is_a_422_naming_it_before_the_sidecar(
    fake_peer, fake, key, most, field
):
    hs = msgspec.to_builtins(Handshake(
        protocol_version=PROTOCOL_VERSION, engine_id="other", epoch=1, agent_name="a",
        agent_metadata=b"", manifest=plan("qwen3-8b"), region_bases=[0]))  # fmt: skip
    where = hs if key == "region_bases" else hs["manifest"]
    where[key] = where[key][:1] * (most + 1)
    err = _error(post(fake_peer, "/v1/handshake", hs), 422)
    assert (err.error, err.field) == ("ValidationError", field)
    assert fake.calls == []


def test_an_unexpected_exception_is_a_500_and_the_peer_app_keeps_answering(fake_peer, fake):
    fake.fail = KeyError("oops")
    resp = post(fake_peer, "/v1/heartbeat", {"hold_ids": [], "extend_s": 1.0})
    assert _error(resp, 500).error == "InternalError"
    assert fake_peer.get("/healthz").status_code == 200


# ------------------------------------------------------------------------------ a real Sidecar


def test_a_compatible_handshake_answers_with_our_identity_and_agent(real):
    resp = post(real.peer, "/v1/handshake", _handshake(real))
    assert resp.status_code == 200, resp.text
    ours = msgspec.json.decode(resp.content, type=Handshake)
    assert (ours.engine_id, ours.epoch, ours.agent_name) == (
        "api-test", real.sidecar.epoch, real.sidecar.agent.name)  # fmt: skip
    assert ours.manifest == real.manifest and len(ours.region_bases) == len(ours.manifest.regions)


def test_a_handshake_tolerates_fields_from_a_newer_peer(real):
    body = _handshake(real, compression="zstd")
    assert post(real.peer, "/v1/handshake", body).status_code == 200


def test_an_incompatible_manifest_is_a_409_naming_every_disagreeing_field(real):
    other = plan("qwen3-8b", num_blocks=4)
    resp = post(real.peer, "/v1/handshake", _handshake(real, manifest=msgspec.to_builtins(other)))
    err = _error(resp, 409)
    assert err.error == "IncompatiblePeerError"
    fields = err.field.split(",")
    assert "groups[0].layers" in fields
    assert all(f in err.detail for f in fields)


def test_a_different_protocol_version_is_a_409_naming_it(real):
    body = _handshake(real, protocol_version=PROTOCOL_VERSION + 1)
    err = _error(post(real.peer, "/v1/handshake", body), 409)
    assert err.field == "protocol_version"


def test_a_reader_receiving_smaller_tcp_segments_than_we_send_is_a_409_naming_them(real):
    """Our READ answers over TCP would come in segments its UCX cannot take (the READ would
    fail with a disconnect), so the handshake says so instead."""
    sent = real.sidecar.agent.tcp_segments[0]
    assert sent > 0
    ours = msgspec.json.decode(post(real.peer, "/v1/handshake", _handshake(real)).content,
                               type=Handshake)  # fmt: skip
    assert (ours.tcp_tx_seg_bytes, ours.tcp_rx_seg_bytes) == real.sidecar.agent.tcp_segments
    err = _error(post(real.peer, "/v1/handshake", _handshake(real, tcp_rx_seg_bytes=sent - 1)), 409)
    assert err.field == "tcp_segments"
    assert f"sends {sent} B" in err.detail and f"receives {sent - 1} B" in err.detail
    # Equal sizes, or a peer that does not state its own, are accepted.
    for rx in (sent, 0):
        assert (
            post(real.peer, "/v1/handshake", _handshake(real, tcp_rx_seg_bytes=rx)).status_code
            == 200
        )


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
    wait_until(lambda: time.time() > ticket.expires_at + 0.01, 10.0, "the hold's lease to end")
    assert _error(_claim(real, ticket), 410).error == "HoldExpiredError"
    assert _claim(real, ticket).status_code in (404, 410)


def test_a_heartbeat_extends_live_holds_and_reports_missing_ones(real):
    ticket = _hold(real)
    body = {"hold_ids": [ticket.hold_id, "gone"], "extend_s": 5.0}
    resp = post(real.peer, "/v1/heartbeat", body)
    assert resp.status_code == 200, resp.text
    beat = msgspec.json.decode(resp.content, type=HeartbeatResponse)
    assert (beat.extended, beat.missing) == ([ticket.hold_id], ["gone"])


def test_an_app_whose_operations_need_a_token_cannot_be_built_without_a_check(fake):
    from fastapi import FastAPI

    from kvxferd.api.operations import Gate, mount
    from kvxferd.api.peer import OPERATIONS

    with pytest.raises(ValueError, match="authorize"):
        mount(FastAPI(), OPERATIONS, fake, Gate())


# ------------------------------------------------------------------------------ what a claim binds


def _resigned(ticket: Ticket, **changes) -> Ticket:
    """The ticket edited and signed again: what a holder of the secret could present."""
    return sign_ticket(msgspec.structs.replace(ticket, **changes), TOKEN.encode())


def test_a_validly_signed_ticket_with_other_block_ids_is_a_409_naming_them(real):
    ticket = _hold(real)
    err = _error(_claim(real, _resigned(ticket, block_ids=[[6]])), 409)
    assert (err.error, err.field) == ("ClaimMismatchError", "ticket.block_ids")
    assert _claim(real, ticket).status_code == 200  # the hold itself is untouched


def test_a_validly_signed_ticket_for_another_request_is_a_409_naming_it(real):
    err = _error(_claim(real, _resigned(_hold(real), request_id="someone-else")), 409)
    assert err.field == "ticket.request_id"


def test_a_ticket_for_another_tp_rank_is_a_409_naming_it(real):
    err = _error(_claim(real, _resigned(_hold(real), tp_rank=1, tp_size=2)), 409)
    assert err.field == "ticket.tp_rank"


def test_a_ticket_of_another_engine_epoch_is_a_404(real):
    ticket = _hold(real)
    err = _error(_claim(real, _resigned(ticket, epoch=ticket.epoch + 1)), 404)
    assert "restarted" in err.detail


@pytest.mark.parametrize("tp", [0, 3, 10**6], ids=["zero", "no-split", "huge"])
def test_a_reader_tp_size_the_manifest_does_not_allow_is_a_422_naming_it(real, tp):
    ticket = _hold(real)
    err = _error(_claim(real, ticket, reader_tp_size=tp), 422)
    assert err.field == "reader_tp_size"
    assert _claim(real, ticket).status_code == 200  # nothing was pinned by the refused claims


def test_a_second_reader_of_a_one_reader_hold_is_a_409(real):
    ticket = _hold(real)
    assert _claim(real, ticket, reader="d0").status_code == 200
    assert _error(_claim(real, ticket, reader="d1"), 409).field == "reader"


def test_the_claim_answer_says_how_long_the_claim_lasts(real):
    claim = msgspec.json.decode(_claim(real, _hold(real)).content, type=ClaimResponse)
    assert claim.claim_s == 5.0 and claim.expires_at > time.time()


def test_an_engine_chosen_hold_id_never_placed_is_a_404_after_the_grace(real):
    ticket = _resigned(_hold(real), hold_id="chosen-never-placed")
    assert _error(_claim(real, ticket), 404).error == "UnknownHoldError"


# ------------------------------------------------------------------------------ decline


def test_decline_releases_only_holds_whose_ticket_matches_and_that_nobody_claimed(real):
    free, claimed, other = _hold(real), _hold(real), _hold(real)
    assert _claim(real, claimed).status_code == 200
    body = DeclineRequest(tickets=[free, claimed, _resigned(other, block_ids=[[4]])],
                          reason="rejected")  # fmt: skip
    resp = post(real.peer, "/v1/decline", body)
    assert resp.status_code == 200, resp.text
    answer = msgspec.json.decode(resp.content, type=DeclineResponse)
    assert (answer.released, answer.busy, answer.missing) == (
        [free.hold_id], [claimed.hold_id], [other.hold_id])  # fmt: skip
    err = _error(_claim(real, free), 404)
    assert "already released (declined)" in err.detail
    again = msgspec.json.decode(post(real.peer, "/v1/decline", body).content, type=DeclineResponse)
    assert free.hold_id in again.missing  # released once, never twice


def test_decline_with_a_tampered_ticket_is_a_401_naming_it_and_releases_nothing(real):
    good = _hold(real)
    bad = msgspec.structs.replace(_hold(real), block_ids=[[7]])
    resp = post(real.peer, "/v1/decline", DeclineRequest(tickets=[good, bad]))
    err = _error(resp, 401)
    assert err.field == "tickets[1].token"
    assert _claim(real, good).status_code == 200


def test_a_peer_decline_or_heartbeat_past_max_tickets_per_call_is_a_422_naming_it(real):
    ticket = _hold(real)
    body = DeclineRequest(tickets=[ticket] * (MAX_TICKETS_PER_CALL + 1))
    assert _error(post(real.peer, "/v1/decline", body), 422).field == "tickets"
    hold_ids = [ticket.hold_id] * (MAX_TICKETS_PER_CALL + 1)
    body = {"hold_ids": hold_ids, "extend_s": 1.0}
    assert _error(post(real.peer, "/v1/heartbeat", body), 422).field == "hold_ids"
    assert _claim(real, ticket).status_code == 200  # nothing released; the sidecar serves on


def test_a_peer_decline_whose_reason_has_a_newline_is_a_422_and_releases_nothing(real):
    ticket = _hold(real)
    body = msgspec.to_builtins(DeclineRequest(tickets=[ticket], reason="rejected\nforged"))
    assert _error(post(real.peer, "/v1/decline", body), 422).field == "reason"
    assert _claim(real, ticket).status_code == 200


def test_leases_run_on_the_monotonic_clock_and_only_the_wire_carries_unix_times(real):
    assert real.sidecar.holds._clock is time.monotonic  # a wall-clock step cannot expire a hold
    before = time.time()
    ticket = _hold(real, lease_s=30.0)
    assert before + 30.0 - 1.0 <= ticket.expires_at <= time.time() + 30.0 + 1.0
