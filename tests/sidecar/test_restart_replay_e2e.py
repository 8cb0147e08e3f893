"""A sidecar restart forgets the nonces it saw, never the trust they carried: a signed peer
request captured before the restart is refused after it (a 401 naming the earliest ts accepted),
over HTTP and over frames, while an honest peer's calls sign again at that ts and go through.

Real ``kvxferd serve`` processes over NIXL loopback, restarted on the same ports.
"""

from __future__ import annotations

import http.client
import socket
import time

import msgspec
import pytest

from kvxferd.pattern import verify_pattern
from kvxferd.sidecar.signing import PeerKeys, sign_request
from kvxferd.wire import ErrorBody, FrameAnswer, FrameRequest, Heartbeat
from kvxferd.wire.frames import frame, frame_length
from tests.api.frameio import recv_exact
from tests.sidecar.harness import QUIET, TOKEN, start_sidecar
from tests.sidecar.ranks import DIDS, Engine

pytestmark = pytest.mark.nixl
KEYS = PeerKeys.of(TOKEN)
PATH = "/v1/heartbeat"
HOLD_ID = "c0ffee" * 5 + "00"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(peer: str, body: bytes, auth: str) -> tuple[int, bytes]:
    host, port = peer.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", PATH, body, {"Authorization": auth,
                                          "Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _frame(port: int, body: bytes, auth: str) -> tuple[int, bytes]:
    req = FrameRequest(id=1, op=f"POST {PATH}", body=msgspec.Raw(body), auth=auth)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(frame(msgspec.msgpack.encode(req)))
        header = recv_exact(sock, 4)
        answer = msgspec.msgpack.decode(recv_exact(sock, frame_length(header)), type=FrameAnswer)
    return answer.status, bytes(answer.body)


def test_a_request_signed_before_a_restart_is_refused_after_it_and_honest_peers_sign_again(
    tmp_path,
):
    port, frames_port = _free_port(), _free_port()
    # A wide window: the decode's pull lands well within the restarted sidecar's first skew_s.
    env = {**QUIET, "KVXFERD_PEER_FRAMES_PORT": str(frames_port), "KVXFERD_AUTH_SKEW_S": "300"}
    p = Engine(start_sidecar(str(tmp_path), "prefill", port=port, env=env))
    d = Engine(start_sidecar(str(tmp_path), "decode", env=QUIET))
    pool = p.pool
    reborn = None
    try:
        p.register()
        d.register()
        ticket = p.hold("before-restart", hold_id=HOLD_ID)  # engine-chosen, as vLLM's
        json_body = msgspec.json.encode(Heartbeat(hold_ids=[ticket.hold_id], extend_s=5.0))
        pack_body = msgspec.msgpack.encode(Heartbeat(hold_ids=[ticket.hold_id], extend_s=5.0))
        # Signed as our client does (again at the floor a fresh sidecar names), captured on
        # their way: both were accepted before the restart.
        status, content = _post(
            p.sidecar.peer, json_body, sign_request(KEYS, "POST", PATH, json_body)
        )
        floor = (msgspec.json.decode(content, type=ErrorBody).not_before if status == 401
                 else int(time.time()))  # fmt: skip
        http_auth = sign_request(KEYS, "POST", PATH, json_body, now=floor)
        frame_auth = sign_request(KEYS, "POST", PATH, pack_body, now=floor)
        assert _post(p.sidecar.peer, json_body, http_auth)[0] == 200
        assert _frame(frames_port, pack_body, frame_auth)[0] == 200

        assert p.sidecar.stop() == 0
        reborn = Engine(start_sidecar(str(tmp_path), "prefill-2", port=port, env=env), pool=pool)
        reborn.register()
        reborn_ticket = reborn.hold("before-restart", hold_id=HOLD_ID)  # placed anew
        assert reborn_ticket.hold_id == ticket.hold_id

        for status, content, codec in (
            (*_post(reborn.sidecar.peer, json_body, http_auth), msgspec.json),
            (*_frame(frames_port, pack_body, frame_auth), msgspec.msgpack),
        ):
            assert status == 401, content
            error = codec.decode(content, type=ErrorBody)
            assert (error.error, error.field) == ("SignedBeforeStartError", "Authorization.ts")
            assert error.not_before > floor
            assert "sign it again" in error.detail

        # The decode, whose calls the restarted peer refuses at first, signs again and pulls
        # every byte (handshake over HTTP, claim over frames).
        status = d.pull([reborn_ticket])
        assert status.state == "done", status
        assert verify_pattern(d.manifest, d.pool.views, DIDS, seed=5) is None
        reborn.released_once(reborn_ticket, "notified")
    finally:
        codes = [s.stop() for s in ((reborn or p).sidecar, d.sidecar)]
        pool.close()
        d.close()
    assert codes == [0, 0]
