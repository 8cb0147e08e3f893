"""The framed peer listener (kvxferd.api.frames on TCP): claims, heartbeats and declines as signed
frames. A frame is admitted only with a signature over its method, path and exact body bytes,
made with the shared secret (which never travels); a missing, tampered, replayed or foreign one
is a 401 before the body is decoded, as over HTTP, and a nonce spent on either listener is spent
on both. The handshake stays on HTTP (its answer names the framed port)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.operations import Gate
from kvxferd.api.peer import FRAME_OPERATIONS, peer_app, peer_gate
from kvxferd.api.sockets import bind_tcp
from kvxferd.sidecar.signing import PeerKeys, sign_request
from kvxferd.wire import ClaimRequest, FrameAnswer, FrameRequest, Ticket
from kvxferd.wire.frames import frame, frame_length
from tests.api import frameio
from tests.api.conftest import KEYS, FakeSidecar
from tests.api.frameio import BOUND_S, recv_exact

LIMITS = FrameLimits(max_connections=8, max_frame_bytes=1 << 20, idle_timeout_s=5.0,
                     frame_timeout_s=5.0)  # fmt: skip
CLAIM = "POST /v1/claims"


@contextmanager
def served(fake: FakeSidecar, gate: Gate) -> Iterator[tuple[str, int]]:
    """The peer frame operations of ``fake`` on a loopback TCP port until the block ends."""
    sock = bind_tcp("127.0.0.1", 0)
    with frameio.served("", fake, LIMITS, operations=FRAME_OPERATIONS, gate=gate, sock=sock):
        yield sock.getsockname()[:2]


def _send(address: tuple[str, int], *requests: FrameRequest) -> list[FrameAnswer]:
    """Send ``requests`` on one connection; their answers, by request order."""
    with socket.create_connection(address, timeout=BOUND_S) as sock:
        answers = {}
        for req in requests:
            sock.sendall(frame(msgspec.msgpack.encode(req)))
            header = recv_exact(sock, 4)
            assert len(header) == 4, "the server closed the connection"
            answer = msgspec.msgpack.decode(
                recv_exact(sock, frame_length(header)), type=FrameAnswer
            )
            answers[answer.id] = answer
    return [answers[req.id] for req in requests]


def _claim_body() -> bytes:
    ticket = Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:1",
    )  # fmt: skip
    claim = ClaimRequest(ticket=ticket, reader="r", reader_tp_size=1, claim_s=1.0)
    return msgspec.msgpack.encode(claim)


def _signed(
    call_id: int, body: bytes, keys: PeerKeys = KEYS, op: str = CLAIM, **kw
) -> FrameRequest:  # noqa: ANN003
    method, path = op.split(" ", 1)
    auth = sign_request(keys, method, path, body)
    return FrameRequest(id=call_id, op=op, body=msgspec.Raw(body), auth=auth, **kw)


def _error(answer: FrameAnswer) -> dict:
    return msgspec.msgpack.decode(answer.body)


@pytest.fixture
def fake() -> FakeSidecar:
    return FakeSidecar()


def test_a_signed_frame_reaches_the_handler(fake):
    with served(fake, peer_gate(fake)) as address:
        (answer,) = _send(address, _signed(1, _claim_body()))
    assert answer.status != 401, _error(answer)
    assert [name for name, _ in fake.calls] == ["claim"]


@pytest.mark.parametrize(
    "make",
    [
        lambda body: FrameRequest(id=1, op=CLAIM, body=msgspec.Raw(body)),
        lambda body: _signed(1, body, PeerKeys.of("another secret")),
        lambda body: FrameRequest(id=1, op=CLAIM, body=msgspec.Raw(body),
                                  auth=_signed(1, b"other bytes").auth),
        lambda body: FrameRequest(id=1, op="POST /v1/decline", body=msgspec.Raw(body),
                                  auth=_signed(1, body).auth),
    ],
    ids=["unsigned", "foreign-secret", "other-body", "other-path"],
)  # fmt: skip
def test_a_frame_without_a_valid_signature_is_a_401_and_never_reaches_the_handler(fake, make):
    with served(fake, peer_gate(fake)) as address:
        (answer,) = _send(address, make(_claim_body()))
    assert answer.status == 401
    assert _error(answer)["error"] == "AuthError"
    assert fake.calls == []


def test_a_replayed_frame_is_refused_on_the_same_and_on_a_new_connection(fake):
    first = _signed(1, _claim_body())
    again = FrameRequest(id=2, op=first.op, body=first.body, auth=first.auth)
    with served(fake, peer_gate(fake)) as address:
        answers = _send(address, first, again)
        (later,) = _send(address, again)
    assert [a.status for a in answers][1] == 401
    assert later.status == 401
    assert "replayed" in _error(later)["detail"]
    assert len(fake.calls) == 1


def test_a_nonce_spent_over_http_is_spent_over_frames_too(fake):
    """One verifier for both listeners: a signed HTTP request cannot be replayed as a frame."""
    gate = peer_gate(fake)
    body = _claim_body()
    auth = sign_request(KEYS, "POST", "/v1/claims", body)
    with TestClient(peer_app(fake, gate), raise_server_exceptions=False) as http:  # type: ignore[arg-type]
        resp = http.post("/v1/claims", content=body, headers={"Authorization": auth})
    assert resp.status_code != 401, resp.text
    with served(fake, gate) as address:
        (answer,) = _send(address, FrameRequest(id=1, op=CLAIM, body=msgspec.Raw(body), auth=auth))
    assert answer.status == 401
    assert "replayed" in _error(answer)["detail"]


def test_a_signed_operation_takes_no_query_over_frames(fake):
    with served(fake, peer_gate(fake)) as address:
        (answer,) = _send(address, _signed(1, _claim_body(), query={"x": "1"}))
    assert answer.status == 400
    assert _error(answer)["field"] == "query"
    assert fake.calls == []


def test_only_the_per_pull_calls_are_framed_the_handshake_stays_on_http(fake):
    with served(fake, peer_gate(fake)) as address:
        hs, hb, dc = _send(
            address,
            _signed(1, _claim_body(), op="POST /v1/handshake"),
            _signed(2, msgspec.msgpack.encode({"tickets": []}), op="POST /v1/heartbeat"),
            _signed(3, msgspec.msgpack.encode({"tickets": []}), op="POST /v1/decline"),
        )
    assert hs.status == 404
    assert hb.status != 404 and dc.status != 404
    assert {op.path for op in FRAME_OPERATIONS} == {"/v1/claims", "/v1/heartbeat", "/v1/decline"}


def test_a_sidecar_without_a_secret_admits_no_frame(fake):
    fake.config.peer_token = ""
    with served(fake, peer_gate(fake)) as address:
        (answer,) = _send(address, _signed(1, _claim_body()))
    assert answer.status == 401
    assert fake.calls == []


def test_signed_operations_are_not_served_without_a_verify_check(fake):
    with pytest.raises(ValueError, match="signature"):
        FrameServer(FRAME_OPERATIONS, fake, Gate(ready=lambda: True), LIMITS)
