"""Every way a pull can go wrong ends in a typed error or a FAILED pull with its reason code.

Real ``kvxferd serve`` processes over NIXL loopback. After each scenario: no success was
reported, nothing was written on the decode side when nothing should have been, every hold
appears exactly once in its sidecar's released feed, no NIXL handle is left on either side,
and the daemons keep serving.
"""

from __future__ import annotations

import os
import secrets
import signal
import time

import httpx
import msgspec
import numpy as np
import pytest

from kvxferd.errors import AuthError, BlockIdError
from kvxferd.pattern import verify_pattern
from kvxferd.sidecar.signing import PeerKeys, sign_request
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    PROTOCOL_VERSION,
    Handshake,
    HoldRequest,
    PullRequest,
    PullStatus,
    Ticket,
)
from tests.sidecar.harness import (
    QUIET,
    TOKEN,
    changed_outside,
    metric,
    peer_signature,
    start_sidecar,
    wait_no_handles,
    wait_until,
)
from tests.sidecar.ranks import DIDS, NUM_BLOCKS, Engine, engine_pair

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A registered prefill and decode sidecar shared by the scenarios that leave them healthy."""
    with engine_pair(str(tmp_path_factory.mktemp("fail"))) as engines:
        yield engines


def _pull(decode: Engine, tickets: list[Ticket], deadline_s: float = 20.0) -> PullStatus:
    with decode.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=tickets, block_ids=DIDS, deadline_s=deadline_s))
        return c.wait_pull(accepted.pull_id, timeout_s=deadline_s + 30)


def _failed_writing_nothing(decode: Engine, tickets: list[Ticket], reason: str) -> PullStatus:
    """Pull, expect FAILED with ``reason``, and not one decode-side byte changed."""
    before = decode.pool.snapshot()
    status = _pull(decode, tickets)
    assert (status.state, status.reason) == ("failed", reason), status
    assert status.kv_bytes == status.state_bytes == 0
    assert all(np.array_equal(b, a) for b, a in zip(before, decode.pool.views, strict=True))
    return status


def _failed_writing_only_its_blocks(
    decode: Engine, tickets: list[Ticket], reason: str
) -> PullStatus:
    """Pull, expect FAILED with ``reason``: its READ ran while the claim was in flight, so it may
    have written the requested blocks, which the finished feed reports invalid; not one byte
    outside them changed and no byte is counted as moved."""
    before = decode.pool.snapshot()
    with decode.sidecar.client() as c:
        cursor = c.finished_pulls(0).cursor
    status = _pull(decode, tickets)
    assert (status.state, status.reason) == ("failed", reason), status
    assert status.kv_bytes == status.state_bytes == 0
    assert changed_outside(before, decode.pool.views, decode.manifest, DIDS) == 0
    with decode.sidecar.client() as c:
        feed = c.finished_pulls(cursor).pulls
    assert [(f.pull_id, f.state, f.failed_block_ids) for f in feed] == [
        (status.pull_id, "failed", DIDS)
    ]
    return status


def _healthy(*engines: Engine) -> None:
    """No NIXL handle left, and the daemons still answer."""
    wait_no_handles(*(e.sidecar for e in engines))
    for e in engines:
        assert httpx.get(f"http://{e.sidecar.peer}/healthz", timeout=10).status_code == 200


def _good_pull(prefill: Engine, decode: Engine, request_id: str, seed: int) -> None:
    ticket = prefill.hold(request_id, seed=seed)
    before = decode.pool.snapshot()
    status = _pull(decode, [ticket])
    assert status.state == "done", status
    assert verify_pattern(decode.manifest, decode.pool.views, DIDS, seed=seed) is None
    assert changed_outside(before, decode.pool.views, decode.manifest, DIDS) == 0
    prefill.released_once(ticket, "notified")


# ------------------------------------------------------------------------------- tickets, holds


def test_unknown_hold_fails_unknown_hold(pair):
    p, d = pair
    real = p.hold("unknown-1")
    # Validly signed (we know the secret) but naming a hold that never existed.
    forged = sign_ticket(
        msgspec.structs.replace(real, hold_id=secrets.token_hex(16)), TOKEN.encode()
    )
    status = _failed_writing_only_its_blocks(d, [forged], "unknown_hold")
    assert forged.hold_id in status.detail
    p.abort(real)
    p.released_once(real, "aborted")
    _healthy(p, d)


def test_expired_holds_fail_hold_expired_never_done(pair):
    """The READ may complete before the claim is refused: the pull still ends FAILED
    (``hold_expired``), and the failed claim does not release the hold again."""
    p, d = pair
    for i in range(3):
        ticket = p.hold(f"expiring-{i}", lease_s=0.2)
        p.released_once(ticket, "expired")  # bounded wait on the feed, not a sleep
        status = _failed_writing_only_its_blocks(d, [ticket], "hold_expired")
        assert "lease ended" in status.detail
        assert p.feed.count(ticket.hold_id) == 1
    _good_pull(p, d, "after-expired", seed=11)  # and the pair still moves bytes correctly
    _healthy(p, d)


def test_tampered_ticket_is_refused_before_the_pull_starts(pair):
    p, d = pair
    ticket = p.hold("tampered-1")
    tampered = msgspec.structs.replace(ticket, block_ids=[[1, 3, 5, 7]])  # token left as is
    before = d.pool.snapshot()
    with d.sidecar.client() as c, pytest.raises(AuthError) as info:
        c.pull(PullRequest(tickets=[tampered], block_ids=DIDS))
    assert info.value.body.field == "tickets[0].token"  # type: ignore[attr-defined]
    assert all(np.array_equal(b, a) for b, a in zip(before, d.pool.views, strict=True))
    # The real hold was never claimed: the engine gives it up, once.
    p.abort(ticket)
    p.released_once(ticket, "aborted")
    _healthy(p, d)


@pytest.mark.parametrize(
    ("block_ids", "where"),
    [
        ([[2, 8, 4, NUM_BLOCKS]], "block_ids[0][3]"),  # out of range
        ([[2, 8, -2, 6]], "block_ids[0][2]"),  # negative (only -1 skips)
        ([[2, 8, 4]], "block_ids[0]"),  # fewer local ids than the ticket has
        ([[2, 8, 4, 6], [1]], "block_ids"),  # a group the manifest does not have
    ],
    ids=["out-of-range", "negative", "short", "wrong-groups"],
)
def test_bad_pull_block_ids_are_422_naming_the_field(pair, block_ids, where):
    p, d = pair
    ticket = p.hold(f"bad-pull-{where}")
    with d.sidecar.client() as c, pytest.raises(BlockIdError) as info:
        c.pull(PullRequest(tickets=[ticket], block_ids=block_ids))
    assert info.value.field == where
    p.abort(ticket)
    p.released_once(ticket, "aborted")
    _healthy(p, d)


@pytest.mark.parametrize(
    ("block_ids", "where"),
    [
        ([[1, NUM_BLOCKS]], "block_ids[0][1]"),
        ([[1], [2]], "block_ids"),
        ([[4, 4]], "block_ids[0][1]"),
    ],
    ids=["out-of-range", "wrong-groups", "repeated"],
)
def test_bad_hold_block_ids_are_422_naming_the_field(pair, block_ids, where):
    p, _ = pair
    with p.sidecar.client() as c, pytest.raises(BlockIdError) as info:
        c.hold(HoldRequest(request_id=f"bad-hold-{where}", block_ids=block_ids, num_tokens=1))
    assert info.value.field == where
    assert p.feed.poll() == []  # nothing was held, so nothing is released


# ------------------------------------------------------------------------------ authentication


def test_peer_api_refuses_unsigned_or_wrongly_signed_calls(pair):
    p, _ = pair
    base = f"http://{p.sidecar.peer}"
    foreign = sign_request(PeerKeys.of("not-the-secret"), "POST", "/v1/claims", b"{}")
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}, {"Authorization": TOKEN},
                    {"Authorization": foreign}):  # fmt: skip
        for path in ("/v1/handshake", "/v1/claims", "/v1/heartbeat", "/v1/decline"):
            resp = httpx.post(base + path, content=b"{}", headers=headers, timeout=10)
            assert resp.status_code == 401, (path, headers, resp.text)
            assert resp.json()["error"] == "AuthError"
    assert httpx.get(base + "/healthz", timeout=10).status_code == 200


def test_a_signature_whose_time_is_not_decimal_is_a_401_and_nothing_unexpected(pair):
    """Our key id travels in clear in every signed call: a header under it whose ``ts`` is hex
    letters is refused as malformed (401), not answered 500 as an unexpected error."""
    p, _ = pair
    base = f"http://{p.sidecar.peer}"
    for path in ("/v1/handshake", "/v1/claims", "/v1/heartbeat", "/v1/decline"):
        good = sign_request(PeerKeys.of(TOKEN), "POST", path, b"{}")
        bad = good.replace(good.split("ts=")[1].split(",")[0], "abc", 1)
        assert "ts=abc," in bad
        resp = httpx.post(base + path, content=b"{}", headers={"Authorization": bad}, timeout=10)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"] == "AuthError" and "ts" in resp.json()["detail"]
    assert httpx.get(base + "/healthz", timeout=10).status_code == 200


def test_decode_side_signing_with_another_secret_fails_auth(pair, tmp_path):
    """The stranger accepts the prefill's tickets (our secret is its second one) but signs with
    a secret the prefill does not know: the prefill refuses its handshake."""
    p, _ = pair
    stranger = Engine(start_sidecar(str(tmp_path), "stranger", env={**QUIET,
                       "KVXFERD_PEER_TOKEN": "another-secret",
                       "KVXFERD_PEER_TOKEN_PREVIOUS": TOKEN}))  # fmt: skip
    try:
        stranger.register()
        ticket = p.hold("stranger-1")
        status = _failed_writing_nothing(stranger, [ticket], "auth")
        assert "signature" in status.detail and "unknown key id" in status.detail
        p.abort(ticket)
        p.released_once(ticket, "aborted")
        _healthy(p, stranger)
    finally:
        assert stranger.sidecar.stop() == 0
        stranger.pool.close()


# ----------------------------------------------------------------------------- compatibility


def test_incompatible_manifests_are_409_naming_the_fields(pair, tmp_path):
    p, _ = pair
    other = Engine(start_sidecar(str(tmp_path), "other-model", env=QUIET), model="qwen3-8b")
    try:
        other.register()
        # Direct: a handshake carrying a manifest of another model is refused field by field.
        hs = Handshake(protocol_version=PROTOCOL_VERSION, engine_id="x", epoch=1, agent_name="x",
                       agent_metadata=b"", manifest=other.manifest, region_bases=[0])  # fmt: skip
        body = msgspec.json.encode(hs)
        auth = peer_signature(p.sidecar, "POST", "/v1/handshake", body)
        resp = httpx.post(f"http://{p.sidecar.peer}/v1/handshake", content=body,
                          headers={"Authorization": auth}, timeout=10)  # fmt: skip
        assert resp.status_code == 409, resp.text
        body = resp.json()
        assert body["error"] == "IncompatiblePeerError"
        assert "groups[0].layers" in body["field"].split(",")
        # Through a pull: FAILED, reason incompatible, the fields in the detail.
        ticket = p.hold("other-model-1")
        status = _failed_writing_nothing(other, [ticket], "incompatible")
        assert "groups[0].layers" in status.detail
        p.abort(ticket)
        p.released_once(ticket, "aborted")
        _healthy(p, other)
    finally:
        assert other.sidecar.stop() == 0
        other.pool.close()


# ------------------------------------------------------------------------ peer death, restart


def test_peer_killed_mid_pull_fails_within_deadline_then_restart_rehandshakes(pair, tmp_path):
    _, d = pair
    victim = Engine(start_sidecar(str(tmp_path), "victim", env=QUIET))
    pool = victim.pool
    try:
        victim.register()
        _good_pull(victim, d, "before-kill", seed=31)  # the decode side now caches this peer

        # Killed while the pull is under way: the prefill process is frozen, the pull gets as
        # far as its claim (observed, not timed), then the process is SIGKILLed.
        ticket = victim.hold("killed-mid-pull")
        os.kill(victim.sidecar.child.pid, signal.SIGSTOP)
        deadline_s = 10.0
        with d.sidecar.client() as c:
            start = time.monotonic()
            pull_id = c.pull(
                PullRequest(tickets=[ticket], block_ids=DIDS, deadline_s=deadline_s)
            ).pull_id
            wait_until(lambda: c.pull_status(pull_id).state == "claiming", 30, "pull in claim")
            victim.sidecar.kill()
            status = c.wait_pull(pull_id, timeout_s=deadline_s + 30)
            elapsed = time.monotonic() - start
        assert (status.state, status.reason) == ("failed", "handshake"), status
        assert elapsed < deadline_s + 5.0  # failed by its deadline (margin for a loaded host)

        # Killed before the pull: the cached peer is gone, the claim cannot connect.
        old_ticket = ticket
        status = _failed_writing_nothing(d, [old_ticket], "handshake")
        assert victim.sidecar.peer in status.detail
        wait_no_handles(d.sidecar)

        # Restarted on the same port with the same pool: a new epoch, so the next pull
        # re-handshakes and moves every byte.
        port = int(victim.sidecar.peer.rsplit(":", 1)[1])
        reborn = Engine(start_sidecar(str(tmp_path), "victim-2", port=port, env=QUIET),
                        pool=pool)  # fmt: skip
        assert reborn.sidecar.peer == victim.sidecar.peer
        assert reborn.sidecar.epoch != victim.sidecar.epoch
        try:
            reborn.register()
            _good_pull(reborn, d, "after-restart", seed=32)
            # A ticket of the old epoch fails cleanly, and does not disturb the new peer.
            status = _failed_writing_nothing(d, [old_ticket], "handshake")
            assert "restarted" in status.detail
            _good_pull(reborn, d, "after-stale-ticket", seed=33)
            # Two handshakes reached the new sidecar (first pull, stale ticket's check); the
            # last pull used the cached peer, which the stale ticket had left in place.
            assert metric(reborn.sidecar.peer, "kvxferd_handshakes_total", outcome="accepted") == 2
            _healthy(reborn, d)
        finally:
            assert reborn.sidecar.stop() == 0
    finally:
        victim.sidecar.kill()
        pool.close()
