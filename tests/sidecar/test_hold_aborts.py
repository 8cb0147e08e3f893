"""HoldTable aborts: an engine giving a hold up (``aborted``, or ``unregistered`` when its memory
goes) never frees blocks a claimed reader may still read, and an id given up before any hold had
it is never placed later. A fake clock drives time; nothing sleeps."""

from __future__ import annotations

import pytest

from kvxferd.errors import DuplicateHoldError, HoldExpiredError, UnknownHoldError
from kvxferd.sidecar.holds import GIVEN_UP_IDS, NotifyOutcome
from kvxferd.sidecar.states import HoldState
from tests.sidecar.holdtable import RES, FakeClock, req, table


def test_abort():
    clock = FakeClock(0.0)
    t = table(clock)
    a = t.hold(req("a"))
    record = t.abort(a.hold_id)
    assert (record.hold_id, record.request_id, record.reason) == (a.hold_id, "a", "aborted")
    assert record.block_ids == [[1, 2], [3]]
    with pytest.raises(UnknownHoldError, match=r"already released \(aborted\)"):
        t.abort(a.hold_id)
    with pytest.raises(UnknownHoldError):
        t.abort("never")
    b = t.hold(req("b", lease_s=1.0))
    clock.t = 2.0
    assert t.abort(b.hold_id).reason == "expired"  # its lease had already ended
    assert {k: v for k, v in t.counters.released.items() if v} == {"expired": 1, "aborted": 1}


def test_a_hold_call_that_arrives_after_its_engines_abort_is_refused():
    """An engine whose hold call got no answer aborts the id it chose; when no hold has it, the
    engine frees those blocks at once. The hold call may still be on its way: it must not
    place a hold a decode could claim over freed blocks. The memory of such ids is bounded."""
    t = table()
    with pytest.raises(UnknownHoldError, match="given up by its engine before placed"):
        t.abort("late-1")
    assert t.was_released("late-1")  # a claim waiting for it stops waiting
    with pytest.raises(DuplicateHoldError, match="given up before it was placed") as err:
        t.hold(req("a", hold_id="late-1"))
    assert err.value.field == "hold_id" and len(t) == 0
    for i in range(GIVEN_UP_IDS):
        with pytest.raises(UnknownHoldError):
            t.abort(f"other-{i}")
    assert t.hold(req("a", hold_id="late-1")).hold_id == "late-1"  # the oldest is forgotten
    with pytest.raises(UnknownHoldError, match="no such hold$"):
        t.abort("not an id!")  # never a hold id: nothing to remember


def test_a_hold_pins_its_blocks_until_released_or_its_lease_ends():
    clock = FakeClock(0.0)
    t = table(clock)
    a, b = t.hold(req("a", lease_s=10.0)), t.hold(req("b", lease_s=10.0))
    a.pinned(9.9)
    with pytest.raises(HoldExpiredError, match="expired"):
        a.pinned(10.0)
    t.abort(b.hold_id)
    with pytest.raises(HoldExpiredError, match="aborted"):
        b.pinned(0.0)


def test_an_abort_of_a_claimed_hold_waits_for_its_reader_and_refuses_new_ones():
    """The reader may be copying the blocks: the hold stays pinned (not in the feed, so the
    engine does not free them) until that reader notifies; nobody else may claim it."""
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req("a", lease_s=30.0))
    t.claim(hold.hold_id, "d0", 5.0, expected_readers=2)
    assert t.abort(hold.hold_id) is None
    assert hold.aborted and hold.state is HoldState.CLAIMED and hold.hold_id in t
    assert (t.active, t.claimed, t.released_since(0).holds) == (1, 1, [])
    for reader in ("d1", "d0"):  # a second reader, or the first claiming again
        with pytest.raises(UnknownHoldError, match="aborted"):
            t.claim(hold.hold_id, reader, 5.0, expected_readers=2)
    assert t.abort(hold.hold_id) is None  # again: nothing changes
    assert t.heartbeat([hold.hold_id], 20.0) == ([], [hold.hold_id])  # not kept alive
    assert hold.readers == {"d0"} and t.released_since(0).holds == []
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.ABORTED
    feed = t.released_since(0)
    assert [(r.hold_id, r.reason) for r in feed.holds] == [(hold.hold_id, "aborted")]
    assert hold.reason == "aborted" and (len(t), t.claimed) == (0, 0)
    assert {k: v for k, v in t.counters.released.items() if v} == {"aborted": 1}
    with pytest.raises(UnknownHoldError, match=r"already released \(aborted\)"):
        t.claim(hold.hold_id, "d1", 5.0)


def test_an_unregister_gives_holds_up_like_an_abort_with_its_own_reason():
    """The engine's memory goes: an unclaimed hold is released ``unregistered`` at once, a
    claimed one only once its reader notified (the memory must outlive that READ)."""
    t = table()
    idle, read = t.hold(req("idle")), t.hold(req("read"))
    t.claim(read.hold_id, "d0", 5.0)
    assert t.abort(idle.hold_id, reason="unregistered").reason == "unregistered"
    assert t.abort(read.hold_id, reason="unregistered") is None
    with pytest.raises(UnknownHoldError, match=r"given up by its engine \(unregistered\)"):
        t.claim(read.hold_id, "d1", 5.0, expected_readers=2)
    assert t.notify(read.hold_id, "d0") is NotifyOutcome.ABORTED
    feed = [(r.hold_id, r.reason) for r in t.released_since(0).holds]
    assert feed == [(idle.hold_id, "unregistered"), (read.hold_id, "unregistered")]


def test_an_aborted_hold_waits_for_every_reader_that_claimed_it_only():
    t = table()
    hold = t.hold(req())
    for reader in ("d0", "d1"):
        t.claim(hold.hold_id, reader, 5.0, expected_readers=3)
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.COUNTED
    assert t.abort(hold.hold_id) is None  # d1 may still be reading
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.DUPLICATE
    # d1 was the last reader that claimed it: the third expected one never will.
    assert t.notify(hold.hold_id, "d1") is NotifyOutcome.ABORTED
    assert hold.reason == "aborted" and len(t) == 0


def test_an_aborted_claimed_hold_whose_reader_never_notifies_expires_when_its_claim_ends():
    """No READ outlives its claim, so the abort cuts a longer lease down to the last claim."""
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req(lease_s=30.0))
    clock.t = 1.0
    t.claim(hold.hold_id, "d0", 5.0)  # reads until 6
    clock.t = 2.0
    assert t.abort(hold.hold_id) is None
    assert hold.expires_at == 6.0 and 6.0 <= t.next_deadline() <= 6.0 + RES
    assert t.reap(now=5.9) == [] and hold.hold_id in t
    assert [(r.hold_id, r.reason) for r in t.reap(now=6.0)] == [(hold.hold_id, "expired")]
    assert (len(t), t.claimed) == (0, 0)
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.UNKNOWN  # too late: counted, ignored


def test_an_abort_releases_at_once_when_no_claimed_reader_can_still_read():
    clock = FakeClock(0.0)
    t = table(clock)
    done = t.hold(req("done"))  # its only reader has notified; a second is still expected
    t.claim(done.hold_id, "d0", 5.0, expected_readers=2)
    t.notify(done.hold_id, "d0")
    ended = t.hold(req("ended", lease_s=30.0))  # its reader's claim is over
    t.claim(ended.hold_id, "d0", 5.0)
    clock.t = 5.0
    assert t.abort(done.hold_id).reason == "aborted"
    assert t.abort(ended.hold_id).reason == "aborted"
    assert len(t) == 0 and t.claimed == 0
