"""Decode-side keepalive between real sidecars: the decode sidecar heartbeats the prefill holds
of queued requests, so a hold outlives its original lease and is still pulled byte-exactly; a
hold that is gone comes back ``missing``, one whose prefill sidecar does not answer
``unanswered``, and a ticket whose MAC does not match is refused naming the ticket."""

from __future__ import annotations

import asyncio
import time

import pytest
from msgspec import structs

from kvxferd import errors
from kvxferd.client import AsyncEngineClient
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import HoldRequest, PullRequest, Ticket
from tests.sidecar.harness import QUIET, TOKEN, EnginePool, ReleasedFeed, plan, start_sidecars

pytestmark = pytest.mark.nixl

MODEL = "llama-3.1-8b"  # one group: block ids are plain lists
LEASE_S = 2.0  # short, so the control hold expires soon; the keepalive comes right after hold
EXTEND_S = 30.0
NOBODY = "127.0.0.1:1"  # nothing listens there


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A registered prefill and decode sidecar, each as (sidecar, manifest, pool)."""
    p, d = start_sidecars(str(tmp_path_factory.mktemp("keepalive")), ["prefill", "decode"],
                          env=QUIET)  # fmt: skip
    manifests = [plan(MODEL, num_blocks=8) for _ in range(2)]
    pools = [EnginePool(m) for m in manifests]
    try:
        for s, m, pool in zip((p, d), manifests, pools, strict=True):
            with s.client() as c:
                c.register(m, pool.specs())
        yield (p, manifests[0], pools[0]), (d, manifests[1], pools[1])
    finally:
        codes = [p.stop(), d.stop()]
        for pool in pools:
            pool.close()
    assert codes == [0, 0]


def _hold(prefill, request_id: str, block_ids: list[list[int]], seed: int = 3) -> Ticket:
    sidecar, manifest, pool = prefill
    write_pattern(manifest, pool.views, block_ids, seed=seed)
    with sidecar.client() as c:
        return c.hold(HoldRequest(request_id=request_id, block_ids=block_ids, num_tokens=32,
                                  lease_s=LEASE_S))  # fmt: skip


def test_a_kept_alive_hold_outlives_its_lease_and_is_pulled_byte_exactly(pair):
    prefill, (d, dm, dpool) = pair
    feed = ReleasedFeed(prefill[0])
    feed.poll()  # start after whatever other tests released
    kept = _hold(prefill, "kept", [[1, 2]], seed=17)
    control = _hold(prefill, "control", [[3]])
    assert control.expires_at >= kept.expires_at  # held later with the same lease

    with d.client() as c:
        answer = c.keepalive([kept, kept], EXTEND_S)  # a repeat counts once
    assert (answer.extended, answer.missing, answer.unanswered) == ([kept.hold_id], [], [])

    # The control hold, never kept alive, expires; by then the kept one's lease is over too.
    assert feed.wait_for(control.hold_id, timeout_s=60) == {control.hold_id: "expired"}
    assert time.time() > kept.expires_at
    assert feed.count(kept.hold_id) == 0

    with d.client() as c:
        pull = c.pull(PullRequest(tickets=[kept], block_ids=[[5, 3]], deadline_s=60))
        status = c.wait_pull(pull.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(dm, dpool.views, [[5, 3]], seed=17) is None
    assert feed.wait_for(kept.hold_id) == {kept.hold_id: "notified"}


def test_a_gone_hold_is_missing_and_a_silent_peer_unanswered(pair):
    prefill, (d, _, _) = pair
    live = _hold(prefill, "live", [[4]])
    gone = _hold(prefill, "gone", [[6]])
    with prefill[0].client() as c:
        c.abort(gone.hold_id)
    stranger = sign_ticket(structs.replace(live, hold_id="h-elsewhere", peer=NOBODY),
                           TOKEN.encode())  # fmt: skip

    async def ask():
        async with AsyncEngineClient(d.socket) as c:
            return await c.keepalive([gone, stranger, live], EXTEND_S)

    answer = asyncio.run(ask())
    assert answer.extended == [live.hold_id]
    assert answer.missing == [gone.hold_id]
    assert answer.unanswered == ["h-elsewhere"]
    with prefill[0].client() as c:
        c.abort(live.hold_id)


def test_a_ticket_whose_mac_does_not_match_is_refused_naming_it(pair):
    prefill, (d, _, _) = pair
    ticket = _hold(prefill, "tampered", [[7]])
    try:
        forged = structs.replace(ticket, hold_id="h-forged")  # MAC no longer matches
        with d.client() as c, pytest.raises(errors.AuthError) as info:
            c.keepalive([ticket, forged], EXTEND_S)
        assert info.value.status == 401 and str(info.value).startswith("tickets[1].token")
        with d.client() as c, pytest.raises(errors.HoldRequestError) as bad:
            c.keepalive([ticket], 0.0)
        assert (bad.value.field, bad.value.status) == ("extend_s", 422)
    finally:
        with prefill[0].client() as c:
            c.abort(ticket.hold_id)
