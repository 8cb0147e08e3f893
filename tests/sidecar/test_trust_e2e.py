"""Trust between real sidecars: the secret never leaves the process, a forged ticket never causes
a connection, keys roll over without a gap, declined holds are released once and never read
successfully, a claim waits briefly for an engine-chosen hold, and the peer metrics are set.

Real ``kvxferd serve`` processes over NIXL loopback; an attacker's address is a real TCP
listener that records every byte it is sent.
"""

from __future__ import annotations

import base64
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from kvxferd.errors import AuthError
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import PullRequest, Ticket
from tests.sidecar.harness import (
    QUIET,
    TOKEN,
    ReleasedFeed,
    changed_outside,
    metric,
    start_sidecars,
    wait_no_handles,
    wait_until,
)
from tests.sidecar.ranks import DIDS, PIDS, Engine

pytestmark = pytest.mark.nixl


class Recorder:
    """A listener at an address a forged ticket might name: counts connections, keeps every
    request line, header and body it receives, and refuses everything with a 401."""

    def __init__(self) -> None:
        recorder = self
        self.connections = 0
        self.received: list[bytes] = []
        self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with recorder.lock:
                    recorder.received.append(self.raw_requestline + bytes(self.headers) + body)
                reply = b'{"error": "AuthError", "detail": "no"}'
                self.send_response(401)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def verify_request(self, request, client_address) -> bool:  # noqa: ANN001
                with recorder.lock:
                    recorder.connections += 1
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def bytes_of(secret: str) -> list[bytes]:
    """Every form the secret could take on the wire."""
    raw = secret.encode()
    return [raw, raw.hex().encode(), raw.hex().upper().encode(), base64.b64encode(raw)]


def _pair(tmp_dir: str, envs: tuple[dict, dict] | None = None, *extra: str):
    p_env, d_env = envs or ({}, {})
    if p_env == d_env:
        p, d = start_sidecars(tmp_dir, ["prefill", "decode"], *extra, env={**QUIET, **p_env})
    else:  # different secrets: start them one by one
        (p,) = start_sidecars(tmp_dir, ["prefill"], *extra, env={**QUIET, **p_env})
        (d,) = start_sidecars(tmp_dir, ["decode"], *extra, env={**QUIET, **d_env})
    return Engine(p).register(), Engine(d).register()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill and a decode that wait up to 30 s for an engine-chosen hold."""
    engines = _pair(str(tmp_path_factory.mktemp("trust")), None, "--hold-grace", "30")
    try:
        yield engines
    finally:
        codes = [e.sidecar.stop() for e in engines]
        for e in engines:
            e.close()
    assert codes == [0, 0]


# ------------------------------------------------------------------------------ the secret


def test_a_decode_sidecar_never_sends_the_secret_to_the_address_a_ticket_names(pair):
    p, d = pair
    listener = Recorder()
    try:
        # A validly signed ticket naming the listener (what a holder of the secret could
        # make): the decode side does contact it, for a pull, a keepalive and a decline.
        real = p.hold("leak-1", seed=3)
        ticket = sign_ticket(msgspec.structs.replace(real, peer=listener.address), TOKEN.encode())
        status = d.pull([ticket], timeout_s=20)
        assert (status.state, status.reason) == ("failed", "auth"), status
        with d.sidecar.client() as c:
            assert c.keepalive([ticket], 5.0).unanswered == [ticket.hold_id]
            assert c.decline([ticket], "rejected").unanswered == [ticket.hold_id]
        sent = listener.received
        paths = sorted(r.split(b" ")[1] for r in sent)
        assert paths == [b"/v1/decline", b"/v1/handshake", b"/v1/heartbeat"]
        assert all(b"Authorization: KVX1 key=" in r for r in sent)
        leaks = [form for r in sent for form in bytes_of(TOKEN) if form in r]
        assert leaks == []
        with p.sidecar.client() as c:
            c.abort(real.hold_id)
    finally:
        listener.close()


def test_a_forged_ticket_is_refused_before_any_connection(pair):
    p, d = pair
    listener = Recorder()
    try:
        real = p.hold("forged-1", seed=4)
        forged = msgspec.structs.replace(real, peer=listener.address)  # MAC no longer matches
        resigned = sign_ticket(forged, b"a guessed secret")
        for bad in (forged, resigned):
            with d.sidecar.client() as c:
                for call in (
                    lambda c=c, bad=bad: c.pull(PullRequest(tickets=[bad], block_ids=DIDS)),
                    lambda c=c, bad=bad: c.keepalive([bad], 5.0),
                    lambda c=c, bad=bad: c.decline([bad]),
                ):
                    with pytest.raises(AuthError) as info:
                        call()
                    assert info.value.body.field == "tickets[0].token"  # type: ignore[attr-defined]
        assert listener.connections == 0 and listener.received == []
        with p.sidecar.client() as c:
            c.abort(real.hold_id)
    finally:
        listener.close()


# ------------------------------------------------------------------------------ decline


def test_a_declined_hold_is_released_once_and_never_read_successfully(pair):
    p, d = pair
    feed = ReleasedFeed(p.sidecar)
    feed.poll()
    ticket = p.hold("declined-1", seed=5)
    with d.sidecar.client() as c:
        answer = c.decline([ticket], "rejected")
    assert (answer.released, answer.missing, answer.unanswered) == ([ticket.hold_id], [], [])
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "declined"}
    before = d.pool.snapshot()
    status = d.pull([ticket], timeout_s=20)
    assert (status.state, status.reason) == ("failed", "unknown_hold"), status
    assert "declined" in status.detail
    # The READ runs while the claim is in flight, so it may have written the requested blocks:
    # they are reported invalid (the pull failed); nothing else changed.
    assert status.kv_bytes == 0
    assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
    with d.sidecar.client() as c:  # declining again changes nothing
        assert c.decline([ticket]).missing == [ticket.hold_id]
    assert feed.count(ticket.hold_id) == 1
    wait_no_handles(p.sidecar, d.sidecar)


# ------------------------------------------------------------------------------ engine-chosen ids


def test_a_claim_waits_for_a_hold_the_scheduler_minted_before_the_worker_placed_it(pair):
    """The engine keeps the named blocks unchanged from minting on (their data is written
    before the ticket goes out): the READ may run before the worker places the hold."""
    p, d = pair
    write_pattern(p.manifest, p.pool.views, PIDS, seed=6)
    with p.sidecar.client() as c:
        generation = c.identity().generation  # the scheduler reads it once per rank
    minted = sign_ticket(Ticket(
        engine_id=p.sidecar.engine_id, epoch=p.sidecar.epoch, hold_id="sched-1",
        request_id="minted-1", block_ids=PIDS, num_tokens=60, expires_at=0.0, tp_rank=0,
        tp_size=1, peer=p.sidecar.peer, generation=generation), TOKEN.encode())  # fmt: skip
    before = d.pool.snapshot()
    with d.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[minted], block_ids=DIDS, deadline_s=60))
        wait_until(lambda: c.pull_status(accepted.pull_id).state in ("claiming", "failed"),
                   30, "the pull to reach its claim")  # fmt: skip
        placed = p.hold("minted-1", seed=6, hold_id="sched-1")  # the worker, a step later
        assert placed.hold_id == "sched-1"
        status = c.wait_pull(accepted.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(d.manifest, d.pool.views, DIDS, seed=6) is None
    assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
    assert ReleasedFeed(p.sidecar).wait_for("sched-1") == {"sched-1": "notified"}


# ------------------------------------------------------------------------------ metrics


def test_the_peer_metrics_count_handshaken_peers_and_epochs(pair):
    p, d = pair
    status = d.pull([p.hold("metrics-1", seed=7)])
    assert status.state == "done", status
    assert metric(d.sidecar.peer, "kvxferd_peers") == 1
    assert metric(d.sidecar.peer, "kvxferd_peer_epochs_seen_total") == 1


# ------------------------------------------------------------------------------ key rotation


def test_sidecars_mid_rollover_read_from_each_other_both_ways(tmp_path):
    """One signs with the old secret and accepts the new one, the other the reverse: each
    accepts the other's signed calls and tickets, so pulls work in both directions."""
    old, new = TOKEN, "the-next-secret"
    a, b = _pair(
        str(tmp_path),
        (
            {"KVXFERD_PEER_TOKEN": old, "KVXFERD_PEER_TOKEN_PREVIOUS": new},
            {"KVXFERD_PEER_TOKEN": new, "KVXFERD_PEER_TOKEN_PREVIOUS": old},
        ),
    )
    try:
        for src, dst, seed in ((a, b, 8), (b, a, 9)):
            status = dst.pull([src.hold(f"rollover-{seed}", seed=seed)])
            assert status.state == "done", status
            assert verify_pattern(dst.manifest, dst.pool.views, DIDS, seed=seed) is None
        wait_no_handles(a.sidecar, b.sidecar)
    finally:
        codes = [e.sidecar.stop() for e in (a, b)]
        for e in (a, b):
            e.close()
    assert codes == [0, 0]
