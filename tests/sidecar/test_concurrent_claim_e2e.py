"""The claim off the critical path: a pull's READ goes out while its claim is in flight, yet the
pull ends DONE only if the claim succeeds, and the hold is notified only after the claim.

Real ``kvxferd serve`` processes over NIXL loopback. A claim is held back deterministically by
an engine-chosen hold id the worker has not placed yet (the prefill waits up to
``--hold-grace`` for it): the READ lands meanwhile, and the test then decides how the claim
ends by what it places.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import HoldRequest, PullRequest, PullStatus, Ticket
from tests.sidecar.harness import (
    TOKEN,
    ReleasedFeed,
    changed_outside,
    wait_no_handles,
    wait_until,
)
from tests.sidecar.ranks import DIDS, PIDS, engine_pair
from tests.sidecar.ranks import Engine as Rank

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill that waits up to 60 s for an engine-chosen hold, and a decode."""
    with engine_pair(str(tmp_path_factory.mktemp("fastclaim")), "--hold-grace", "60") as ranks:
        yield ranks


def _mint(p: Rank, hold_id: str, seed: int) -> Ticket:
    """What the scheduler does: the blocks hold their data from now on, the ticket is signed
    for a hold id the worker places later."""
    write_pattern(p.manifest, p.pool.views, PIDS, seed=seed)
    s = p.sidecar
    with s.client() as c:
        generation = c.identity().generation  # the scheduler reads it once per rank
    return sign_ticket(Ticket(
        engine_id=s.engine_id, epoch=s.epoch, hold_id=hold_id, request_id=f"req-{hold_id}",
        block_ids=PIDS, num_tokens=60, expires_at=0.0, tp_rank=0, tp_size=1, peer=s.peer,
        generation=generation,
    ), TOKEN.encode())  # fmt: skip


def _read_landed_while_claiming(d: Rank, pull_id: str, seed: int) -> None:
    """Bounded wait until the READ's bytes are in the decode's blocks; the pull is then still
    claiming (its claim waits for a hold not placed yet)."""
    wait_until(lambda: verify_pattern(d.manifest, d.pool.views, DIDS, seed=seed) is None,
               30, "the READ's bytes in the decode blocks")  # fmt: skip
    with d.sidecar.client() as c:
        assert c.pull_status(pull_id).state == "claiming"


def _feed(p: Rank) -> ReleasedFeed:
    """The prefill's released feed, from now on."""
    feed = ReleasedFeed(p.sidecar)
    feed.poll()
    feed.seen.clear()
    return feed


def _feed_entry(d: Rank, status: PullStatus) -> tuple[str, list[list[int]]]:
    with d.sidecar.client() as c:
        (entry,) = [f for f in c.finished_pulls(0).pulls if f.pull_id == status.pull_id]
    return entry.state, entry.failed_block_ids


def test_the_read_lands_before_the_claim_answers_and_the_hold_is_notified_after_it(pair):
    p, d = pair
    feed = _feed(p)
    ticket = _mint(p, "early-1", seed=31)
    before = d.pool.snapshot()
    with d.sidecar.client() as c:
        pull_id = c.pull(PullRequest(tickets=[ticket], block_ids=DIDS, deadline_s=60)).pull_id
        _read_landed_while_claiming(d, pull_id, seed=31)
        assert feed.poll() == []  # nothing released while the claim is outstanding
        with p.sidecar.client() as pc:  # the worker places the hold, a step later
            pc.hold(HoldRequest(request_id="req-early-1", block_ids=PIDS, num_tokens=60,
                                hold_id="early-1"))  # fmt: skip
        status = c.wait_pull(pull_id, timeout_s=90)
    assert status.state == "done", status
    assert status.kv_bytes > 0
    assert verify_pattern(d.manifest, d.pool.views, DIDS, seed=31) is None
    assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
    # Released by our notification, which went out only once the claim was recorded (one
    # sent with the READ, before the claim, would have been ignored: the hold would expire).
    assert feed.wait_for("early-1") == {"early-1": "notified"}
    assert feed.count("early-1") == 1
    wait_no_handles(p.sidecar, d.sidecar)


def test_a_claim_that_fails_after_the_read_completed_fails_the_pull(pair):
    """The READ is done, then the claim is refused (409: the hold placed under that id has
    other blocks): the pull ends FAILED with the claim's reason, counts no bytes, reports its
    blocks invalid, and sends no notification (the hold stays until the engine aborts it)."""
    p, d = pair
    feed = _feed(p)
    ticket = _mint(p, "refused-1", seed=32)
    before = d.pool.snapshot()
    with d.sidecar.client() as c:
        pull_id = c.pull(PullRequest(tickets=[ticket], block_ids=DIDS, deadline_s=60)).pull_id
        _read_landed_while_claiming(d, pull_id, seed=32)
        with p.sidecar.client() as pc:
            pc.hold(HoldRequest(request_id="req-refused-1", block_ids=[[2, 4, 6, 8]],
                                num_tokens=60, hold_id="refused-1"))  # fmt: skip
        status = c.wait_pull(pull_id, timeout_s=90)
    assert (status.state, status.reason) == ("failed", "auth"), status
    assert "block_ids" in status.detail
    assert (status.kv_bytes, status.state_bytes, status.descriptors) == (0, 0, 0)
    assert _feed_entry(d, status) == ("failed", DIDS)
    assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
    wait_no_handles(p.sidecar, d.sidecar)
    assert feed.poll() == []  # no notification released it
    with p.sidecar.client() as pc:
        pc.abort("refused-1")
    assert feed.wait_for("refused-1") == {"refused-1": "aborted"}


def test_a_hold_released_before_its_claim_lands_fails_the_pull_even_if_read(pair):
    """Aborted between minting and the claim (the engine's own choice): the claim answers 404
    whatever the READ did, and the pull ends FAILED ``unknown_hold``, never DONE."""
    p, d = pair
    feed = _feed(p)
    with p.sidecar.client() as pc:
        write_pattern(p.manifest, p.pool.views, PIDS, seed=33)
        ticket = pc.hold(HoldRequest(request_id="req-gone-1", block_ids=PIDS, num_tokens=60))
        pc.abort(ticket.hold_id)
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "aborted"}
    before = d.pool.snapshot()
    with d.sidecar.client() as c:
        status = c.run_pull(PullRequest(tickets=[ticket], block_ids=DIDS, deadline_s=30))
    assert (status.state, status.reason) == ("failed", "unknown_hold"), status
    assert "aborted" in status.detail
    assert status.kv_bytes == 0
    assert _feed_entry(d, status) == ("failed", DIDS)
    assert changed_outside(before, d.pool.views, d.manifest, DIDS) == 0
    assert feed.count(ticket.hold_id) == 1
    wait_no_handles(p.sidecar, d.sidecar)


def test_a_rank_with_nothing_to_read_still_claims_then_releases_its_hold(pair):
    """Every local block skipped (-1): no READ, and the hold is released by the notification
    sent once the claim answered."""
    p, d = pair
    feed = _feed(p)
    write_pattern(p.manifest, p.pool.views, PIDS, seed=34)
    with p.sidecar.client() as pc:
        ticket = pc.hold(HoldRequest(request_id="req-skip-1", block_ids=PIDS, num_tokens=60))
    before = d.pool.snapshot()
    with d.sidecar.client() as c:
        status = c.run_pull(PullRequest(tickets=[ticket], block_ids=[[-1] * 4], deadline_s=30))
    assert status.state == "done", status
    assert (status.kv_bytes, status.descriptors) == (0, 0)
    assert all(np.array_equal(b, a) for b, a in zip(before, d.pool.views, strict=True))
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}


def test_these_reads_take_the_post_thread_so_they_are_posted_before_their_claim_is_sent():
    # The cases above then cover the order a large READ takes: handed to its post thread just
    # before the claim is sent (a small one is posted on the loop after the claim left).
    from kvxferd.descriptors import plan_read
    from kvxferd.sidecar.reads import Reads

    m = Rank.plan()
    read = plan_read(m, m, [np.asarray(DIDS[0])], [np.asarray(PIDS[0])])
    assert not Reads.inline(read.total_bytes, read.num_descriptors)
