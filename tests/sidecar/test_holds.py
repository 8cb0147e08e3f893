"""HoldTable: leases, claims, notifications and the reaper.

A fake clock drives time; nothing sleeps. The central property: every hold is released exactly
once whatever the interleaving, and no hold outlives its deadline once the reaper has run.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvxferd.errors import (
    BlockIdError,
    CapacityError,
    ClaimMismatchError,
    ConfigError,
    DuplicateHoldError,
    HoldExpiredError,
    HoldRequestError,
    UnknownHoldError,
)
from kvxferd.sidecar.holds import HoldTable, NotifyOutcome
from kvxferd.sidecar.states import HoldState
from kvxferd.wire import HOLD_SPARE_BLOCKS, MAX_TOKENS, HoldRequest
from tests.sidecar.holdtable import NUM_BLOCKS, RES, FakeClock, manifest, req, table

# -- hold ----------------------------------------------------------------------------------------


def test_hold_pins_blocks_under_a_lease():
    clock = FakeClock(50.0)
    t = table(clock)
    a = t.hold(req("a"))
    b = t.hold(req("b", lease_s=5.0))
    c = t.hold(req("c", lease_s=1e6))
    assert len({a.hold_id, b.hold_id, c.hold_id}) == 3
    assert (a.expires_at, b.expires_at, c.expires_at) == (80.0, 55.0, 150.0)  # default, own, cap
    assert a.state is HoldState.HELD and a.block_ids == [[1, 2], [3]] and a.num_tokens == 32
    assert t.get(a.hold_id) is a and t.find_request("b") is b and a.hold_id in t
    assert (len(t), t.active, t.counters.held) == (3, 3, 3)


@pytest.mark.parametrize(
    ("block_ids", "field"),
    [
        ([[1, NUM_BLOCKS], [3]], "block_ids[0][1]"),
        ([[1, 2], [-1]], "block_ids[1][0]"),
        ([[1, 2, 1], [3]], "block_ids[0][2]"),
        ([[1, 2], [3, 5, 3, 5]], "block_ids[1][2]"),  # the first repeat
        ([[1, 2]], "block_ids"),
        ([[1], [2], [3]], "block_ids"),
    ],
)
def test_bad_block_ids_name_the_field(block_ids, field):
    t = table()
    with pytest.raises(BlockIdError) as err:
        t.hold(req(block_ids=block_ids))
    assert err.value.field == field
    assert len(t) == 0 and t.counters.held == 0


def test_same_block_in_two_groups_and_empty_groups_are_fine():
    t = table()
    assert t.hold(req(block_ids=[[4], [4]])).block_ids == [[4], [4]]
    assert t.hold(req("r2", block_ids=[[], []])).block_ids == [[], []]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (req(lease_s=0.0), "lease_s"),
        (req(lease_s=-1.0), "lease_s"),
        (req(lease_s=math.nan), "lease_s"),
        (req(lease_s=math.inf), "lease_s"),
        (req(num_tokens=-1), "num_tokens"),
        (req(num_tokens=MAX_TOKENS + 1), "num_tokens"),
    ],
)
def test_bad_hold_arguments_name_the_field(request_, field):
    with pytest.raises(HoldRequestError) as err:
        table().hold(request_)
    assert err.value.field == field


def test_a_hold_of_max_tokens_is_taken():
    assert table().hold(req(num_tokens=MAX_TOKENS)).num_tokens == MAX_TOKENS


@pytest.mark.parametrize(
    ("num_tokens", "most"),
    [(0, 1), (1, 1), (16, 1), (17, 2), (32, 2)],  # blocks of 16 tokens, at least one
)
def test_a_group_lists_at_most_the_blocks_its_tokens_span_plus_the_spare(num_tokens, most):
    """vLLM's lookahead: a Mamba group gets a state block per draft token, attention the
    slots they need; up to HOLD_SPARE_BLOCKS past the span are taken, nulls included."""
    t = table()
    spec = [0] * (most + HOLD_SPARE_BLOCKS - 2) + [5, 6]
    hold = t.hold(req(block_ids=[spec, [7]], num_tokens=num_tokens))
    assert len(hold.block_ids[0]) == most + HOLD_SPARE_BLOCKS
    with pytest.raises(BlockIdError) as err:
        t.hold(req("r2", block_ids=[[1], [0, *spec]], num_tokens=num_tokens))
    assert err.value.field == "block_ids[1]"
    assert f"need at most {most + HOLD_SPARE_BLOCKS}" in str(err.value)
    assert len(t) == 1


def test_a_flood_of_null_blocks_is_refused_by_its_length_before_any_id_is_looked_at():
    """The length names the group, not the bad id at the end: nothing was walked or kept."""
    t = table()
    flood = [0] * 1_000_000 + [NUM_BLOCKS]
    with pytest.raises(BlockIdError) as err:
        t.hold(req(block_ids=[[1], flood], num_tokens=32))
    assert err.value.field == "block_ids[1]"
    assert len(t) == 0 and t.counters.held == 0


def test_a_request_id_has_at_most_one_live_hold_and_placing_it_twice_gives_the_first_up():
    """The engine frees a refused request's blocks: its live hold could not be read after."""
    clock = FakeClock()
    t = table(clock)
    first = t.hold(req("r1", lease_s=10))
    with pytest.raises(DuplicateHoldError, match=f"{first.hold_id}: given up") as err:
        t.hold(req("r1"))
    assert err.value.field == "request_id"
    assert len(t) == 0 and [r.reason for r in t.released_since(0).holds] == ["aborted"]
    second = t.hold(req("r1", lease_s=10))
    # Past its deadline (reaper not run yet): it expires now and the new hold is accepted.
    clock.t += 10
    third = t.hold(req("r1"))
    assert second.reason == "expired" and t.find_request("r1") is third


def test_the_same_hold_placed_again_is_that_hold_with_its_lease_unchanged():
    clock = FakeClock()
    t = table(clock)
    terms = {"request_id": "r1", "block_ids": [[1], [2]], "num_tokens": 1, "hold_id": "h-1"}
    first = t.hold(HoldRequest(**terms, lease_s=10))
    clock.t += 4
    assert t.hold(HoldRequest(**terms, lease_s=30)) is first
    assert first.expires_at == first.created_at + 10 and len(t) == t.counters.held == 1
    for other in ({"num_tokens": 2}, {"block_ids": [[1], [3]]}, {"hold_id": "h-2"}):
        t = table(clock)
        held = t.hold(HoldRequest(**terms))
        with pytest.raises(DuplicateHoldError):  # not the same hold: refused, the first given up
            t.hold(HoldRequest(**{**terms, **other}))
        assert held.hold_id not in t and len(t) == 0


def test_table_configuration_is_checked():
    with pytest.raises(ConfigError, match="default_lease_s"):
        table(default_lease_s=200.0)
    with pytest.raises(ConfigError, match="max_claim_s"):
        table(max_claim_s=0)
    with pytest.raises(ConfigError, match="max_holds"):
        table(max_holds=0)


def test_a_hold_past_max_holds_is_refused_naming_the_limit_and_leaves_nothing():
    # Distinct request ids may hold the same blocks again and again: the table is what bounds.
    t = table(max_holds=2)
    first = t.hold(req("a"))
    t.hold(req("b"))
    with pytest.raises(CapacityError) as err:
        t.hold(req("c", block_ids=[[1, 2], [3]]))
    assert err.value.field == "max_holds" and err.value.status == 503
    assert len(t) == 2 and t.counters.held == 2 and t.find_request("c") is None
    t.abort(first.hold_id)
    assert t.hold(req("c")).request_id == "c"  # a released hold makes room


def test_a_full_table_makes_room_from_holds_past_their_deadline_before_refusing():
    clock = FakeClock()
    t = table(clock, max_holds=2)
    old = t.hold(req("a", lease_s=5))
    t.hold(req("b", lease_s=50))
    clock.t += 5  # "a" is past its deadline; the reaper has not run
    assert t.hold(req("c")).request_id == "c"
    assert old.reason == "expired" and len(t) == 2


# -- claim ---------------------------------------------------------------------------------------


def test_claim_pins_the_hold_for_at_least_claim_s():
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req(lease_s=10.0))
    clock.t = 4.0
    grant = t.claim(hold.hold_id, "reader-a", claim_s=20.0, expected_readers=2)
    assert grant.hold_id == hold.hold_id and grant.hold is hold
    assert (grant.expires_at, grant.expected_readers, grant.headroom_s) == (24.0, 2, 6.0)
    assert hold.state is HoldState.CLAIMED and hold.readers == {"reader-a"}
    # A shorter claim never shortens the deadline; a second reader joins the same hold.
    grant = t.claim(hold.hold_id, "reader-b", claim_s=1.0, expected_readers=1)
    assert (grant.expires_at, grant.expected_readers) == (24.0, 2)
    assert hold.readers == {"reader-a", "reader-b"}
    # claim_s is capped.
    assert t.claim(hold.hold_id, "reader-a", claim_s=1e9).expires_at == 4.0 + 60.0
    assert (t.counters.claimed, t.counters.claims, t.claimed) == (1, 3, 1)


def test_claim_of_an_unknown_hold():
    t = table()
    with pytest.raises(UnknownHoldError, match="no such hold"):
        t.claim("nope", "reader", 5.0)


def test_claim_after_the_lease_ended_fails_even_before_the_reaper_runs():
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req(lease_s=10.0))
    clock.t = 10.0  # the lease ends exactly now
    with pytest.raises(HoldExpiredError, match=hold.hold_id):
        t.claim(hold.hold_id, "reader", 5.0)
    assert hold.state is HoldState.RELEASED and hold.reason == "expired"
    with pytest.raises(HoldExpiredError):  # still "expired", not a second release
        t.claim(hold.hold_id, "reader", 5.0)
    assert t.reap(now=100.0) == []
    feed = t.released_since(0)
    assert [(r.hold_id, r.reason) for r in feed.holds] == [(hold.hold_id, "expired")]
    assert t.counters.released == {"notified": 0, "expired": 1, "aborted": 0, "declined": 0,
                                   "unregistered": 0}  # fmt: skip


def test_claim_of_a_released_hold_says_why():
    t = table()
    hold = t.hold(req())
    t.claim(hold.hold_id, "reader", 5.0)
    assert t.notify(hold.hold_id, "reader") is NotifyOutcome.RELEASED
    with pytest.raises(UnknownHoldError, match=r"already released \(notified\)"):
        t.claim(hold.hold_id, "reader", 5.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(claim_s=0.0), "claim_s"),
        (dict(claim_s=math.nan), "claim_s"),
        (dict(reader=""), "reader"),
        (dict(expected_readers=-1), "expected_readers"),
    ],
)
def test_bad_claim_arguments_name_the_field(kwargs, field):
    t = table()
    hold = t.hold(req())
    args = dict(reader="reader", claim_s=5.0, expected_readers=1) | kwargs
    with pytest.raises(HoldRequestError) as err:
        t.claim(hold.hold_id, **args)
    assert err.value.field == field
    assert hold.state is HoldState.HELD


# -- notify ------------------------------------------------------------------------------------


def test_hold_is_released_when_every_expected_reader_notified():
    t = table()
    hold = t.hold(req())
    t.claim(hold.hold_id, "d0", 5.0, expected_readers=2)
    t.claim(hold.hold_id, "d1", 5.0, expected_readers=2)
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.COUNTED
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.DUPLICATE
    assert hold.state is HoldState.CLAIMED
    assert t.notify(hold.hold_id, "d1") is NotifyOutcome.RELEASED
    assert hold.state is HoldState.RELEASED and hold.reason == "notified"
    assert t.notify(hold.hold_id, "d1") is NotifyOutcome.UNKNOWN
    assert t.notify("bogus", "d1") is NotifyOutcome.UNKNOWN
    c = t.counters
    assert (c.notifications, c.notifications_duplicate, c.notifications_unknown) == (2, 1, 2)
    assert c.released["notified"] == 1 and len(t) == 0 and t.claimed == 0


def test_unknown_notifications_are_counted_each_and_logged_once_a_second(caplog):
    """Anyone holding our agent metadata may notify as fast as UCX carries it: every unknown
    notification is counted, but logged once a second (with the count), not once each."""
    caplog.set_level("INFO", logger="kvxferd.sidecar.holds")
    clock = FakeClock()
    t = table(clock)
    t.hold(req("req-1"))
    for i in range(1000):
        assert t.notify(f"h{i}", "stranger") is NotifyOutcome.UNKNOWN
        assert t.notify_request(f"r{i}", "stranger") is NotifyOutcome.UNKNOWN
    clock.t += 1.0
    assert t.notify("late", "stranger") is NotifyOutcome.UNKNOWN
    assert t.counters.notifications_unknown == 2001
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(logged) == 2, logged[:3]
    assert "2001 unknown so far" in logged[1]


def test_only_a_reader_that_claimed_releases_by_notification():
    """A notification from an agent that never claimed is ignored (counted as unknown)."""
    t = table()
    hold = t.hold(req("req-9"))
    assert t.notify_request("req-9", "stranger") is NotifyOutcome.UNKNOWN
    assert hold.state is HoldState.HELD and t.counters.notifications_unknown == 1
    t.claim(hold.hold_id, "d0", 5.0)
    assert t.notify(hold.hold_id, "stranger") is NotifyOutcome.UNKNOWN
    assert hold.state is HoldState.CLAIMED
    assert t.notify_request("req-9", "d0") is NotifyOutcome.RELEASED
    assert hold.reason == "notified"
    assert t.notify_request("req-9", "d0") is NotifyOutcome.UNKNOWN


def test_an_ignored_notification_is_logged_on_one_bounded_line(caplog):
    """Its hold id and reader are whatever a peer sent: quoted and cut, never a forged line."""
    t = table()
    with caplog.at_level("INFO", logger="kvxferd.sidecar.holds"):
        forged = "h\n2026-01-01 ERROR kvxferd: forged line" + "x" * 100_000
        assert t.notify(forged, "agent\nname" * 10_000) is NotifyOutcome.UNKNOWN
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and len(record.getMessage()) < 1024


def test_notification_after_the_deadline_releases_as_expired():
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req(lease_s=3.0))
    t.claim(hold.hold_id, "d0", 1.0)
    clock.t = 3.5
    assert t.notify(hold.hold_id, "d0") is NotifyOutcome.EXPIRED
    assert hold.reason == "expired" and t.counters.released["expired"] == 1


# -- heartbeat -----------------------------------------------------------------------------------


def test_heartbeat_extends_live_holds_and_reports_missing_ones():
    clock = FakeClock(0.0)
    t = table(clock)
    a = t.hold(req("a", lease_s=10.0))
    b = t.hold(req("b", lease_s=2.0))
    c = t.hold(req("c", lease_s=50.0))
    t.abort(c.hold_id)
    clock.t = 5.0
    extended, missing = t.heartbeat([a.hold_id, b.hold_id, c.hold_id, "x", a.hold_id], 20.0)
    assert extended == [a.hold_id] and missing == [b.hold_id, c.hold_id, "x"]
    assert a.expires_at == 25.0
    assert b.reason == "expired"  # overdue: released, never revived
    # Never shortens; capped by max_lease_s.
    assert t.heartbeat([a.hold_id], 1.0) == ([a.hold_id], [])
    assert a.expires_at == 25.0
    t.heartbeat([a.hold_id], 1e9)
    assert a.expires_at == 105.0
    with pytest.raises(HoldRequestError) as err:
        t.heartbeat([a.hold_id], -1.0)
    assert err.value.field == "extend_s"


# -- reaper --------------------------------------------------------------------------------------


def test_reap_releases_in_deadline_order_not_insertion_order():
    clock = FakeClock(0.0)
    t = table(clock)
    holds = {n: t.hold(req(n, lease_s=lease)) for n, lease in (("a", 30), ("b", 10), ("c", 20))}
    assert 10.0 <= t.next_deadline() <= 10.0 + RES
    assert t.reap(now=9.99) == []
    released = t.reap(now=100.0)
    assert [r.request_id for r in released] == ["b", "c", "a"]
    assert all(h.reason == "expired" for h in holds.values())
    assert t.next_deadline() is None and len(t) == 0


def test_extended_and_claimed_holds_expire_at_their_new_deadline():
    clock = FakeClock(0.0)
    t = table(clock)
    a = t.hold(req("a", lease_s=5.0))
    b = t.hold(req("b", lease_s=6.0))
    t.heartbeat([a.hold_id], 20.0)  # a: 20
    t.claim(b.hold_id, "d0", 12.0)  # b: 12
    assert 12.0 <= t.next_deadline() <= 12.0 + RES  # the old deadlines (5, 6) are gone
    assert t.reap(now=11.0) == []
    assert [r.request_id for r in t.reap(now=12.0)] == ["b"]
    assert 20.0 <= t.next_deadline() <= 20.0 + RES
    t.abort(a.hold_id)
    assert t.next_deadline() is None
    assert t.reap(now=1e9) == []


def test_the_schedule_stays_bounded_under_many_extensions():
    """Extensions move a hold between buckets; nothing accumulates, nothing is ever rebuilt."""
    clock = FakeClock(0.0)
    t = table(clock)
    hold = t.hold(req(lease_s=1.0))
    for i in range(1000):
        clock.t = i * 0.5
        t.heartbeat([hold.hold_id], 1.0)
    assert len(t._deadlines) == 1 and t._deadlines.buckets <= 1000
    assert t.next_deadline() is not None
    assert hold.expires_at <= t.next_deadline() <= hold.expires_at + RES
    t.reap(now=hold.expires_at)
    assert t._deadlines.buckets == 0 and t.next_deadline() is None


# -- property: released exactly once -------------------------------------------------------------

READERS = ("d0", "d1", "d2")


class HoldInterleavings(RuleBasedStateMachine):
    """Random hold/claim/notify/abort/heartbeat/reap/tick sequences against a fake clock."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(0.0)
        self.table = HoldTable(
            manifest(),
            clock=self.clock,
            default_lease_s=5.0,
            max_lease_s=20.0,
            max_claim_s=8.0,
        )
        self.created: list[str] = []
        self.released: dict[str, str] = {}
        self.cursor = 0
        self.requests = 0

    def _pick(self, i: int) -> str:
        return self.created[i] if i < len(self.created) else f"bogus-{i}"

    @rule(lease=st.none() | st.floats(0.5, 30.0))
    def hold(self, lease):
        self.requests += 1
        hold = self.table.hold(req(f"q{self.requests}", lease_s=lease))
        self.created.append(hold.hold_id)

    @rule(i=st.integers(0, 40), reader=st.sampled_from(READERS), claim_s=st.floats(0.1, 15.0),
          readers=st.integers(1, 3))  # fmt: skip
    def claim(self, i, reader, claim_s, readers):
        hold_id = self._pick(i)
        overdue = hold_id in self.table and self.table.get(hold_id).expires_at <= self.clock.t
        try:
            grant = self.table.claim(hold_id, reader, claim_s, readers)
        except HoldExpiredError:
            assert hold_id in self.created
            return
        except UnknownHoldError:
            assert hold_id not in self.table or self.table.get(hold_id).aborted
            return
        except ClaimMismatchError:  # more distinct readers than the first claim expects
            hold = self.table.get(hold_id)
            assert reader not in hold.readers and len(hold.readers) >= hold.expected_readers
            return
        assert not overdue, "an overdue hold was claimed"
        assert grant.expires_at >= self.clock.t + min(claim_s, 8.0)

    @rule(i=st.integers(0, 40), reader=st.sampled_from(READERS))
    def notify(self, i, reader):
        self.table.notify(self._pick(i), reader)

    @rule(i=st.integers(0, 40))
    def abort(self, i):
        hold_id, now = self._pick(i), self.clock.t
        hold = self.table.get(hold_id) if hold_id in self.table else None
        reading = hold is not None and hold.expires_at > now and hold.claimed_until > now and (
            bool(hold.readers - hold.notified))  # fmt: skip
        try:
            record = self.table.abort(hold_id)
        except UnknownHoldError:
            assert hold is None
            return
        assert (record is None) == reading, "released under a reader, or kept for nobody"

    @rule(picks=st.lists(st.integers(0, 40), max_size=4), extend=st.floats(0.1, 30.0))
    def heartbeat(self, picks, extend):
        extended, missing = self.table.heartbeat([self._pick(i) for i in picks], extend)
        assert all(self.table.get(h).expires_at > self.clock.t for h in extended)
        assert all(h not in self.table or self.table.get(h).aborted for h in missing)

    @rule()
    def reap(self):
        self.table.reap()
        assert all(h.expires_at > self.clock.t for h in self.table.live())
        deadline = self.table.next_deadline()
        live = [h.expires_at for h in self.table.live()]
        if live:
            assert deadline is not None and min(live) <= deadline <= min(live) + RES
        else:
            assert deadline is None

    @rule(dt=st.floats(0.0, 10.0))
    def tick(self, dt):
        self.clock.t += dt

    @invariant()
    def every_hold_released_at_most_once_and_none_lost(self):
        feed = self.table.released_since(self.cursor)
        for record in feed.holds:
            assert record.hold_id not in self.released, "released twice"
            self.released[record.hold_id] = record.reason
        self.cursor = feed.cursor
        live = {h.hold_id for h in self.table.live()}
        assert live.isdisjoint(self.released)
        assert live | self.released.keys() == set(self.created)
        assert sum(self.table.counters.released.values()) == len(self.released)
        assert self.table.claimed == sum(h.state is HoldState.CLAIMED for h in self.table.live())
        for h in self.table.live():  # an aborted hold is kept only for its claimed readers
            assert not h.aborted or (h.readers - h.notified and h.expires_at <= h.claimed_until)


TestHoldInterleavings = HoldInterleavings.TestCase
TestHoldInterleavings.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
