"""HoldTable's released feed and what a claim binds: the feed is cursor-addressed, paged and
bounded in records and bytes; reaping works in slices; a claim binds the hold's exact block ids,
TP shape and readers; an engine may choose hold ids; a decline releases once."""

from __future__ import annotations

import pytest

from kvxferd.errors import (
    BlockIdError,
    ClaimMismatchError,
    DuplicateHoldError,
    HoldRequestError,
    UnknownHoldError,
)
from kvxferd.sidecar.holds import DeclineOutcome, NotifyOutcome
from kvxferd.sidecar.states import HoldState
from kvxferd.wire import HoldRequest
from tests.sidecar.holdtable import NUM_BLOCKS, FakeClock, req, table

# -- released feed -------------------------------------------------------------------------------


def test_released_feed_is_cursor_addressed():
    t = table()
    ids = [t.hold(req(f"r{i}")).hold_id for i in range(5)]
    assert t.released_since(0).holds == [] and t.released_since(0).cursor == 0
    for hold_id in ids[:3]:
        t.abort(hold_id)
    feed = t.released_since(0)
    assert [r.hold_id for r in feed.holds] == ids[:3] and feed.cursor == 3
    assert t.released_since(feed.cursor).holds == []
    t.claim(ids[3], "d0", 1.0)
    t.notify(ids[3], "d0")
    page = t.released_since(feed.cursor)
    assert [(r.hold_id, r.reason) for r in page.holds] == [(ids[3], "notified")]
    assert page.cursor == 4
    limited = t.released_since(0, limit=2)
    assert [r.hold_id for r in limited.holds] == ids[:2] and limited.cursor == 2
    # A cursor from before a sidecar restart (beyond the newest) starts from the oldest kept.
    assert len(t.released_since(99).holds) == 4
    with pytest.raises(HoldRequestError):
        t.released_since(-1)


def test_released_feed_is_bounded_and_overrun_is_logged(caplog):
    t = table(released_log_size=3)
    ids = [t.hold(req(f"r{i}")).hold_id for i in range(5)]
    for hold_id in ids:
        t.abort(hold_id)
    feed = t.released_since(0)
    assert [r.hold_id for r in feed.holds] == ids[2:] and feed.cursor == 5
    assert "overran: 2 releases" in caplog.text
    # Evicted entries no longer explain themselves; kept ones do.
    with pytest.raises(UnknownHoldError, match="no such hold"):
        t.claim(ids[0], "d", 1.0)
    with pytest.raises(UnknownHoldError, match="already released"):
        t.claim(ids[4], "d", 1.0)


# -- what a claim binds (issue 10) ---------------------------------------------------------------


def test_a_claim_binds_the_exact_block_ids_of_the_hold():
    t = table()
    hold = t.hold(req(block_ids=[[1, 2], [3]]))
    with pytest.raises(ClaimMismatchError) as err:
        t.claim(hold.hold_id, "d0", 5.0, block_ids=[[1, 2], [4]])
    assert err.value.field == "ticket.block_ids" and hold.state is HoldState.HELD
    assert t.claim(hold.hold_id, "d0", 5.0, block_ids=[[1, 2], [3]]).hold is hold


def test_a_claim_binds_the_reader_tp_size_and_the_number_of_readers():
    t = table()
    hold = t.hold(req())
    t.claim(hold.hold_id, "d0", 5.0, expected_readers=2, reader_tp_size=2)
    with pytest.raises(ClaimMismatchError) as err:  # another TP shape
        t.claim(hold.hold_id, "d1", 5.0, expected_readers=4, reader_tp_size=4)
    assert err.value.field == "reader_tp_size"
    t.claim(hold.hold_id, "d1", 5.0, expected_readers=2, reader_tp_size=2)
    t.claim(hold.hold_id, "d1", 5.0, expected_readers=2, reader_tp_size=2)  # again: same reader
    with pytest.raises(ClaimMismatchError) as err:  # a third reader of a 2-reader hold
        t.claim(hold.hold_id, "d2", 5.0, expected_readers=2, reader_tp_size=2)
    assert err.value.field == "reader" and hold.readers == {"d0", "d1"}


def test_a_readers_first_notification_does_not_release_the_hold_under_its_second_claim():
    """The same tickets pulled twice (or a decode rank that claims again) run two READs: the
    first one's notification must leave the blocks pinned for the second."""
    t = table()
    hold = t.hold(req())
    t.claim(hold.hold_id, "d0", 5.0)
    t.claim(hold.hold_id, "d0", 5.0)
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.COUNTED
    assert hold.reason is None and t.released_since(0).holds == []
    assert t.abort(hold.hold_id) is None  # a READ of it may still be running
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.ABORTED
    released = [(r.hold_id, r.reason) for r in t.released_since(0).holds]
    assert released == [(hold.hold_id, "aborted")]


def test_a_reader_that_notified_and_claims_again_keeps_the_hold_until_it_notifies_again():
    t = table()
    hold = t.hold(req())
    t.claim(hold.hold_id, "d0", 5.0, expected_readers=2)
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.COUNTED
    t.claim(hold.hold_id, "d0", 5.0, expected_readers=2)
    t.claim(hold.hold_id, "d1", 5.0, expected_readers=2)
    assert t.notify(hold.hold_id, "d1") is NotifyOutcome.COUNTED
    assert hold.reason is None
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.RELEASED
    assert hold.reason == "notified"
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.UNKNOWN


def test_a_claim_by_a_shape_that_reads_nothing_here_releases_the_hold():
    t = table()
    hold = t.hold(req())
    grant = t.claim(hold.hold_id, "d0", 5.0, expected_readers=0, reader_tp_size=1)
    assert grant.expected_readers == 0 and hold.reason == "notified" and len(t) == 0


def test_a_claim_grants_at_most_max_claim_s_and_says_so():
    clock = FakeClock(0.0)
    t = table(clock, max_claim_s=60.0)
    hold = t.hold(req(lease_s=5.0))
    grant = t.claim(hold.hold_id, "d0", 1e6)
    assert grant.granted_s == 60.0 and grant.expires_at == hold.expires_at == 60.0


# -- engine-chosen hold ids, the null block, decline ---------------------------------------------


def test_an_engine_chosen_hold_id_is_used_and_never_reused():
    t = table()
    hold = t.hold(HoldRequest(request_id="a", block_ids=[[1], [2]], num_tokens=1, hold_id="h-1"))
    assert hold.hold_id == "h-1"
    with pytest.raises(DuplicateHoldError) as err:
        t.hold(HoldRequest(request_id="b", block_ids=[[3], [4]], num_tokens=1, hold_id="h-1"))
    assert err.value.field == "hold_id"
    t.abort("h-1")
    with pytest.raises(DuplicateHoldError):  # a released id is remembered too
        t.hold(HoldRequest(request_id="c", block_ids=[[3], [4]], num_tokens=1, hold_id="h-1"))
    for bad in ("a b", "h-2\n"):  # a final newline too (a regex "$" lets it through)
        with pytest.raises(HoldRequestError) as err:
            t.hold(HoldRequest(request_id="d", block_ids=[[3], [4]], num_tokens=1, hold_id=bad))
        assert err.value.field == "hold_id"


def test_the_null_block_is_a_placeholder_that_may_repeat_but_other_ids_may_not():
    t = table()
    hold = t.hold(req(block_ids=[[0, 0, 0, 7], [0, 3]]))
    assert hold.block_ids == [[0, 0, 0, 7], [0, 3]]  # positions kept as the engine gave them
    with pytest.raises(BlockIdError) as err:
        t.hold(req("r2", block_ids=[[0, 5, 0, 5], [1]]))
    assert err.value.field == "block_ids[0][3]"
    with pytest.raises(BlockIdError) as err:
        t.hold(req("r3", block_ids=[[0, NUM_BLOCKS], [1]]))
    assert err.value.field == "block_ids[0][1]"


def test_decline_releases_an_unclaimed_hold_with_the_tickets_block_ids_once():
    t = table()
    a, b, c = (t.hold(req(n, block_ids=[[i], [i + 1]])) for i, n in ((1, "a"), (3, "b"), (5, "c")))
    assert t.decline(a.hold_id, [[9], [2]]) is DeclineOutcome.MISSING  # other block ids
    assert t.decline(a.hold_id, [[1], [2]]) is DeclineOutcome.RELEASED
    assert a.reason == "declined"
    assert t.decline(a.hold_id, [[1], [2]]) is DeclineOutcome.MISSING  # released once only
    t.claim(b.hold_id, "d0", 5.0)
    assert t.decline(b.hold_id, [[3], [4]]) is DeclineOutcome.BUSY  # a reader may be reading
    assert b.state is HoldState.CLAIMED
    assert t.decline("never", [[5], [6]]) is DeclineOutcome.MISSING
    feed = t.released_since(0)
    assert [(r.hold_id, r.reason) for r in feed.holds] == [(a.hold_id, "declined")]
    with pytest.raises(UnknownHoldError, match=r"already released \(declined\)"):
        t.claim(a.hold_id, "d0", 5.0)
    assert c.hold_id in t


# -- bounded work and memory ---------------------------------------------------------------------


def test_reap_in_slices_releases_at_most_max_items_per_call():
    clock = FakeClock(0.0)
    t = table(clock)
    ids = {t.hold(req(f"q{i}", block_ids=[[1], [2]], lease_s=1.0)).hold_id for i in range(25)}
    clock.t = 5.0
    slices = []
    while released := t.reap(max_items=10):
        slices.append(len(released))
    assert slices == [10, 10, 5] and len(t) == 0
    assert {r.hold_id for r in t.released_since(0).holds} == ids


def test_the_released_feed_is_bounded_in_bytes_and_paged():
    from kvxferd.sidecar.released import record_bytes

    t = table(released_log_size=1000, released_log_bytes=20_000)
    big = [list(range(1, 16)), list(range(1, 16))]  # 30 ids: about 1.7 KB a record
    ids = []
    for i in range(30):
        hold = t.hold(req(f"b{i}", block_ids=big))
        ids.append(hold.hold_id)
        t.abort(hold.hold_id)
    assert t.released_bytes <= 20_000
    kept = t.released_since(0, limit=1000)
    assert 0 < len(kept.holds) < 30 and [r.hold_id for r in kept.holds] == ids[-len(kept.holds) :]
    assert sum(record_bytes(r) for r in kept.holds) == t.released_bytes
    page = t.released_since(0, limit=4)
    assert len(page.holds) == 4 and page.more
    rest = t.released_since(page.cursor, limit=1000)
    assert not rest.more and [r.hold_id for r in page.holds + rest.holds] == [
        r.hold_id for r in kept.holds]  # fmt: skip
