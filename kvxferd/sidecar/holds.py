"""The prefill side's record of pinned blocks: holds with leases, claims, notifications.

A hold pins a request's blocks until every expected decode reader has notified, the engine aborts
it, or its lease (extended by claims and heartbeats) runs out. Whatever the path and the order,
each hold is released exactly once, and each release is appended to a cursor-addressed feed the
engine polls to free its blocks.

An abort (or an unregister) never pulls blocks from under a reader: an unclaimed hold is released
at once, but a claimed one is only marked aborted. It takes no new claim, heartbeat or reader, and
is released (``aborted`` or ``unregistered``) once every reader that claimed it has notified, or
(``expired``) when the last claim ends, whichever comes first; the engine frees the blocks when
the feed says so.

Expiry is checked by every call that touches a hold, not only by the reaper: a hold whose deadline
has passed is released as ``expired`` by the first call that notices, so an expired hold can never
be claimed or read "successfully" because the reaper was late.

Time comes from an injected clock (seconds, default ``time.monotonic``: a wall-clock step must
not expire a hold mid-READ); every method also takes an explicit ``now``. Absolute Unix times
exist only on the wire (the sidecar converts). Not thread-safe by design: the sidecar calls it
from its asyncio loop only, and every method is synchronous and short (the reaper releases in
slices of ``max_items``), so no lock is needed.

What a claim binds: the ticket's exact block ids (they must equal the hold's), one reader TP
size for the hold's life (its expected readers follow from it), and the readers themselves: no
more distinct readers than expected, and only a reader that claimed may release the hold by
notification (anyone else's notification is counted as unknown and ignored). A hold that
expects no reader (its units are all read from replicas on other ranks) is released by its
first claim.

Block 0 is vLLM's null block: block lists keep it as a placeholder (Mamba groups are mostly
null blocks with the running state last; sliding-window groups null out evicted blocks), so a
hold may name it, any number of times, but it is never data: it is not pinned, and a pull never
reads or writes it. How many ids a group lists is bounded all the same: the blocks the hold's
tokens span plus HOLD_SPARE_BLOCKS, checked before any id is looked at.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvxferd.errors import (
    CapacityError,
    ClaimMismatchError,
    ConfigError,
    DuplicateHoldError,
    HoldExpiredError,
    HoldRequestError,
    UnknownHoldError,
)
from kvxferd.sidecar.deadlines import DeadlineBuckets
from kvxferd.sidecar.hold import ClaimGrant, DeclineOutcome, Hold, HoldCounters, NotifyOutcome
from kvxferd.sidecar.hold_request import check_hold_ids, check_num_tokens
from kvxferd.sidecar.released import ReleasedLog
from kvxferd.sidecar.states import HoldState, advance
from kvxferd.wire import (
    HOLD_ID_PATTERN,
    DeclineResponse,
    HoldReleaseReason,
    HoldRequest,
    Manifest,
    ReleasedHold,
    ReleasedHolds,
    Ticket,
)

if TYPE_CHECKING:
    from kvxferd.config import Config

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
REAP_SLICE = 256
"""Holds the reaper releases before it yields the event loop."""
UNKNOWN_LOG_S = 1.0
"""Unknown notifications are logged at most once this often (each is counted): anyone holding
our agent metadata may send them as fast as UCX carries them."""
GIVEN_UP_IDS = 4096
"""Engine-chosen hold ids given up before any hold had them, remembered (newest) so that a
late hold call with one is refused: the engine freed those blocks when the abort found none."""
_HOLD_ID = re.compile(HOLD_ID_PATTERN)


def _positive(value: float, name: str) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise HoldRequestError(name, f"must be a finite number > 0, got {value!r}")
    return float(value)


class HoldTable:
    """Live holds of one prefill rank, their deadlines (a lazy-deletion heap) and release feed."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        clock: Clock = time.monotonic,
        default_lease_s: float = 30.0,
        max_lease_s: float = 600.0,
        max_claim_s: float = 120.0,
        max_holds: int = 65536,
        released_log_size: int = 65536,
        released_log_bytes: int = 64 << 20,
        reap_resolution_s: float = 0.05,
    ) -> None:
        for name, value in (
            ("default_lease_s", default_lease_s),
            ("max_lease_s", max_lease_s),
            ("max_claim_s", max_claim_s),
            ("max_holds", max_holds),
            ("released_log_size", released_log_size),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}: must be > 0, got {value!r}")
        if default_lease_s > max_lease_s:
            raise ConfigError(f"default_lease_s: {default_lease_s} exceeds max_lease_s")
        self.num_blocks = manifest.num_blocks
        self.block_sizes = tuple(g.block_size for g in manifest.groups)
        self.default_lease_s = float(default_lease_s)
        self.max_lease_s = float(max_lease_s)
        self.max_claim_s = float(max_claim_s)
        self.max_holds = int(max_holds)
        self.counters = HoldCounters()
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        self._by_request: dict[str, str] = {}
        self._deadlines = DeadlineBuckets(reap_resolution_s)
        self._released = ReleasedLog(int(released_log_size), int(released_log_bytes))
        self._given_up: OrderedDict[str, None] = OrderedDict()  # bounded by GIVEN_UP_IDS
        self._claimed_live = 0
        self._unknown_logged_at = -math.inf  # when an unknown notification was last logged

    @classmethod
    def configured(cls, manifest: Manifest, config: Config) -> HoldTable:
        """The table of ``config``'s leases and bounds, on the monotonic clock (a wall-clock
        step must not expire a hold mid-READ)."""
        return cls(
            manifest,
            default_lease_s=config.default_lease_s,
            max_lease_s=config.max_lease_s,
            max_claim_s=config.max_claim_s,
            max_holds=config.max_holds,
            released_log_bytes=config.released_feed_bytes,
            clock=time.monotonic,
        )

    # -- queries ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def active(self) -> int:
        """Live holds (held or claimed)."""
        return len(self._holds)

    @property
    def claimed(self) -> int:
        """Live holds in state CLAIMED (a reader may be reading now)."""
        return self._claimed_live

    def released_counts(self) -> dict[str, int]:
        """Holds released so far, by reason (a copy)."""
        return dict(self.counters.released)

    def __contains__(self, hold_id: object) -> bool:
        return hold_id in self._holds

    def get(self, hold_id: str) -> Hold:
        """The live hold ``hold_id`` (expired-but-unreaped included), else UnknownHoldError."""
        hold = self._holds.get(hold_id)
        if hold is None:
            raise UnknownHoldError(self._unknown_detail(hold_id))
        return hold

    def pinning(self, hold_id: str) -> tuple[list[list[int]], int, Callable[[], None]]:
        """A live hold's block ids and tokens, for a store save, and a check that it still pins
        them (run after each entry's copy; HoldExpiredError once it does not)."""
        hold = self.get(hold_id)
        hold.pinned(self._now(None))
        return hold.block_ids, hold.num_tokens, lambda: hold.pinned(self._now(None))

    def was_released(self, hold_id: str) -> bool:
        """Whether ``hold_id`` was released (or given up before it was placed) recently enough
        to be remembered: no hold will have it."""
        return self._released.get(hold_id) is not None or hold_id in self._given_up

    def find_request(self, request_id: str) -> Hold | None:
        """The live hold of an engine request id, if any."""
        hold_id = self._by_request.get(request_id)
        return None if hold_id is None else self._holds[hold_id]

    def live(self) -> list[Hold]:
        """Every live hold (a snapshot list)."""
        return list(self._holds.values())

    def next_deadline(self) -> float | None:
        """When the reaper should next run: at or after the earliest live deadline, within the
        reap resolution of it; None when nothing is held."""
        return self._deadlines.next_end()

    @property
    def released_bytes(self) -> int:
        """Estimated bytes of the released feed kept for the engine."""
        return self._released.bytes

    # -- operations ------------------------------------------------------------------------------

    def hold(
        self, request: HoldRequest, now: float | None = None, *,
        checked: Callable[[], object] | None = None,
    ) -> Hold:  # fmt: skip
        """Pin a request's blocks for ``request.lease_s`` (default if None, capped by the max);
        CapacityError (503) while ``max_holds`` unexpired holds are live. ``checked`` runs once
        the request passed its checks, before anything is touched, and raises to refuse it.

        The same hold placed again (its id, request, blocks and tokens) is that hold, lease
        unchanged. A request with another live hold is refused (409) and that hold given up
        (``aborted``): an engine frees a refused request's blocks, so it could not be read."""
        now = self._now(now)
        if request.hold_id and not _HOLD_ID.fullmatch(request.hold_id):
            raise HoldRequestError("hold_id", "1-128 characters of A-Z a-z 0-9 . _ : -")
        check_num_tokens(request.num_tokens, HoldRequestError)
        check_hold_ids(self.num_blocks, self.block_sizes, request.num_tokens, request.block_ids)
        lease = self.default_lease_s
        if request.lease_s is not None:
            lease = min(_positive(request.lease_s, "lease_s"), self.max_lease_s)
        if checked is not None:
            checked()
        existing = self.find_request(request.request_id)
        if existing is not None and not self._expire_if_due(existing, now):
            if (request.hold_id, request.block_ids, request.num_tokens) == (
                    existing.hold_id, existing.block_ids, existing.num_tokens):  # fmt: skip
                return existing
            with contextlib.suppress(UnknownHoldError):
                self.abort(existing.hold_id, now)
            raise DuplicateHoldError("request_id", f"{request.request_id!r} already had live "
                                     f"hold {existing.hold_id}: given up")  # fmt: skip
        hold_id = request.hold_id
        if hold_id and (hold_id in self._holds or self._released.get(hold_id) is not None):
            raise DuplicateHoldError("hold_id", f"{hold_id!r} is already (or was) a hold here")
        if hold_id in self._given_up:  # a call that arrived after its engine's abort
            raise DuplicateHoldError("hold_id", f"{hold_id!r} was given up before it was placed")
        if len(self._holds) >= self.max_holds:
            self.reap(now, REAP_SLICE)  # expired ones the reaper has not reached yet go first
            if len(self._holds) >= self.max_holds:
                raise CapacityError(
                    "max_holds", f"{len(self._holds)} holds are live; retry when one is released"
                )
        while not hold_id or hold_id in self._holds or self._released.get(hold_id) is not None:
            hold_id = secrets.token_hex(16)
        hold = Hold(
            hold_id=hold_id,
            request_id=request.request_id,
            block_ids=[list(ids) for ids in request.block_ids],
            num_tokens=request.num_tokens,
            created_at=now,
            expires_at=now + lease,
        )
        self._holds[hold_id] = hold
        self._by_request[hold.request_id] = hold_id
        self._deadlines.set(hold_id, hold.expires_at)
        self.counters.held += 1
        return hold

    def claim(
        self,
        hold_id: str,
        reader: str,
        claim_s: float,
        expected_readers: int = 1,
        now: float | None = None,
        *,
        block_ids: list[list[int]] | None = None,
        request_id: str | None = None,
        reader_tp_size: int = 0,
    ) -> ClaimGrant:
        """Pin a hold while ``reader`` reads it: deadline becomes at least now + claim_s (capped).

        Several readers may claim the same hold (heterogeneous TP), all with the same
        ``reader_tp_size`` (when given) and at most ``expected_readers`` distinct ones; the hold
        then waits for every one of them. ``block_ids`` and ``request_id``, when given, must be
        the hold's.
        ClaimMismatchError names what does not bind. A hold expecting 0 readers is released
        (``notified``) by this claim.
        """
        now = self._now(now)
        claim_s = min(_positive(claim_s, "claim_s"), self.max_claim_s)
        if not reader:
            raise HoldRequestError("reader", "must be a non-empty reader name")
        if not (isinstance(expected_readers, int) and expected_readers >= 0):
            raise HoldRequestError("expected_readers", f"must be >= 0, got {expected_readers!r}")
        hold = self._live(hold_id, now)
        if hold.aborted:
            raise UnknownHoldError(f"hold_id {hold_id!r}: given up by its engine ({hold.aborted})")
        if block_ids is not None and block_ids != hold.block_ids:
            raise ClaimMismatchError("ticket.block_ids", "are not the block ids of this hold")
        if request_id is not None and request_id != hold.request_id:
            raise ClaimMismatchError("ticket.request_id", "is not the request of this hold")
        if reader_tp_size and hold.reader_tp_size not in (0, reader_tp_size):
            raise ClaimMismatchError(
                "reader_tp_size", f"{reader_tp_size}, but the hold was claimed by TP "
                f"{hold.reader_tp_size} readers",
            )  # fmt: skip
        if hold.reading and expected_readers != hold.expected_readers and reader_tp_size:
            raise ClaimMismatchError("reader_tp_size", "expects another number of readers")
        readers = max(hold.expected_readers if hold.reading else 0, expected_readers)
        if reader not in hold.reading and len(hold.reading) >= max(readers, 1):
            raise ClaimMismatchError(
                "reader", f"the hold already has its {len(hold.reading)} expected reader(s)"
            )
        headroom = hold.expires_at - now
        if hold.state is HoldState.HELD:
            hold.state = advance(hold.state, HoldState.CLAIMED)
            self.counters.claimed += 1
            self._claimed_live += 1
        hold.reading[reader] = hold.reading.get(reader, 0) + 1
        hold.reader_tp_size = hold.reader_tp_size or reader_tp_size
        hold.expected_readers = readers
        self.counters.claims += 1
        grant = ClaimGrant(
            hold_id=hold.hold_id,
            hold=hold,
            expires_at=max(hold.expires_at, now + claim_s),
            expected_readers=readers,
            headroom_s=headroom,
            granted_s=claim_s,
        )
        if readers == 0:  # nobody of this TP shape reads this rank: nothing to wait for
            self._release(hold, "notified", now)
        else:
            hold.claimed_until = max(hold.claimed_until, now + claim_s)
            self._extend(hold, now + claim_s)
        return grant

    def notify(self, hold_id: str, reader: str, now: float | None = None) -> NotifyOutcome:
        """Record that ``reader`` finished reading; release once every expected reader has.

        Only a reader that claimed the hold counts; anyone else's notification is UNKNOWN.
        """
        now = self._now(now)
        hold = self._holds.get(hold_id)
        if hold is None or reader not in hold.reading:
            self._unknown(now, reader, "hold", hold_id)
            return NotifyOutcome.UNKNOWN
        if self._expire_if_due(hold, now):
            return NotifyOutcome.EXPIRED
        if not hold.reading[reader]:
            self.counters.notifications_duplicate += 1
            return NotifyOutcome.DUPLICATE
        hold.reading[reader] -= 1
        self.counters.notifications += 1
        if hold.reading[reader]:  # another READ of this reader's is still running
            return NotifyOutcome.COUNTED
        if hold.aborted and not any(hold.reading.values()):
            self._release(hold, hold.aborted, now)
            return NotifyOutcome.ABORTED
        if sum(not n for n in hold.reading.values()) >= hold.expected_readers:
            self._release(hold, "notified", now)
            return NotifyOutcome.RELEASED
        return NotifyOutcome.COUNTED

    def notify_request(
        self, request_id: str, reader: str, now: float | None = None
    ) -> NotifyOutcome:
        """``notify`` addressed by the engine's request id instead of the hold id."""
        hold_id = self._by_request.get(request_id)
        if hold_id is None:
            self._unknown(self._now(now), reader, "request", request_id)
            return NotifyOutcome.UNKNOWN
        return self.notify(hold_id, reader, now)

    def abort(
        self, hold_id: str, now: float | None = None, reason: HoldReleaseReason = "aborted"
    ) -> ReleasedHold | None:
        """Give a hold up at the engine's request (``reason``: ``aborted``, or ``unregistered``
        when its memory goes): its release record (``reason``, or ``expired`` if it was), or None
        when readers that claimed it may still be reading. An id no hold has yet is remembered
        as given up (a hold call with it that arrives later is refused) and UnknownHoldError.

        Such a hold takes no new claim and no heartbeat from now on; it is released for
        ``reason`` when the last of its claimed readers notifies, else as ``expired`` when the
        last claim ends (that bounds every READ). Giving it up again changes nothing.
        """
        now = self._now(now)
        hold = self._holds.get(hold_id)
        if hold is None:
            if self._released.get(hold_id) is None and _HOLD_ID.fullmatch(hold_id):
                self._given_up[hold_id] = None  # a hold call still on its way is refused
                while len(self._given_up) > GIVEN_UP_IDS:
                    self._given_up.popitem(last=False)
            raise UnknownHoldError(self._unknown_detail(hold_id))
        if self._expire_if_due(hold, now):
            record = self._released.get(hold_id)
            assert record is not None  # just appended
            return record
        if any(hold.reading.values()) and hold.claimed_until > now:
            if not hold.aborted:
                hold.aborted = reason
                hold.expires_at = hold.claimed_until  # no READ of it outlives its last claim
                self._deadlines.set(hold_id, hold.expires_at)
                logger.info("hold %s given up (%s) while claimed: released once its readers "
                            "are done", hold_id, reason)  # fmt: skip
            return None
        return self._release(hold, reason, now)

    def decline(
        self, hold_id: str, block_ids: list[list[int]], request_id: str | None = None,
        now: float | None = None,
    ) -> DeclineOutcome:  # fmt: skip
        """Release a hold its decode side will not read (``declined``), if ``block_ids`` (and
        ``request_id``, when given) are the hold's and no reader has claimed it."""
        now = self._now(now)
        hold = self._holds.get(hold_id)
        if hold is None or self._expire_if_due(hold, now) or hold.block_ids != block_ids:
            return DeclineOutcome.MISSING
        if request_id is not None and request_id != hold.request_id:
            return DeclineOutcome.MISSING
        if hold.state is HoldState.CLAIMED:
            return DeclineOutcome.BUSY
        self._release(hold, "declined", now)
        return DeclineOutcome.RELEASED

    def decline_tickets(
        self, tickets: Iterable[Ticket], here: tuple[str, int, int]
    ) -> DeclineResponse:
        """:meth:`decline` the hold of each (verified) ticket; a ticket naming another engine,
        epoch or registration generation than ``here``'s is ``missing``, as a claim's is."""
        out: dict[DeclineOutcome, list[str]] = {o: [] for o in DeclineOutcome}
        for ticket in tickets:
            ours = (ticket.engine_id, ticket.epoch, ticket.generation) == here
            outcome = (
                self.decline(ticket.hold_id, ticket.block_ids, ticket.request_id)
                if ours else DeclineOutcome.MISSING
            )  # fmt: skip
            out[outcome].append(ticket.hold_id)
        return DeclineResponse(
            released=out[DeclineOutcome.RELEASED],
            missing=out[DeclineOutcome.MISSING],
            busy=out[DeclineOutcome.BUSY],
        )

    def heartbeat(
        self, hold_ids: Iterable[str], extend_s: float, now: float | None = None
    ) -> tuple[list[str], list[str]]:
        """Push each live hold's deadline to at least now + extend_s (capped by max_lease_s).

        Returns (extended, missing); a hold already past its deadline is released as expired and
        reported missing, never revived; an aborted one is missing too (left as it is).
        """
        now = self._now(now)
        extend_s = min(_positive(extend_s, "extend_s"), self.max_lease_s)
        extended: list[str] = []
        missing: list[str] = []
        for hold_id in dict.fromkeys(hold_ids):
            hold = self._holds.get(hold_id)
            if hold is None or self._expire_if_due(hold, now) or hold.aborted:
                missing.append(hold_id)
            else:
                self._extend(hold, now + extend_s)
                extended.append(hold_id)
        return extended, missing

    def reap(self, now: float | None = None, max_items: int | None = None) -> list[ReleasedHold]:
        """Release, in deadline order (to the reap resolution), holds whose deadline is at or
        before ``now``: all of them, or at most ``max_items`` (call again while it returns
        that many, yielding in between)."""
        now = self._now(now)
        due = self._deadlines.due(
            now, len(self._holds) if max_items is None else max_items,
            lambda h: self._holds[h].expires_at,
        )  # fmt: skip
        return [self._release(self._holds[h], "expired", now) for h in due]

    def released_since(self, cursor: int, limit: int | None = None) -> ReleasedHolds:
        """One page of releases after ``cursor`` (oldest first, at most ``limit`` records and
        about a MiB) and the cursor to pass next; ``more`` when newer ones wait. Cursors count
        releases from 1 (see kvxferd.sidecar.released)."""
        return self._released.since(cursor, limit)

    # -- internals -------------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _live(self, hold_id: str, now: float) -> Hold:
        """The live hold, or UnknownHoldError / HoldExpiredError (releasing it if just expired)."""
        hold = self._holds.get(hold_id)
        if hold is None:
            record = self._released.get(hold_id)
            if record is not None and record.reason == "expired":
                raise HoldExpiredError(f"hold_id {hold_id!r}: lease ended, blocks may be reused")
            raise UnknownHoldError(self._unknown_detail(hold_id))
        if self._expire_if_due(hold, now):
            raise HoldExpiredError(f"hold_id {hold_id!r}: lease ended, blocks may be reused")
        return hold

    def _unknown(self, now: float, reader: str, what: str, name: str) -> None:
        """Count an unknown notification; log it unless one was logged within UNKNOWN_LOG_S."""
        self.counters.notifications_unknown += 1
        if now - self._unknown_logged_at >= UNKNOWN_LOG_S:
            self._unknown_logged_at = now
            logger.info("notification from %r for unknown %s %r ignored (%d unknown so far)",
                        reader[:200], what, name[:200],
                        self.counters.notifications_unknown)  # fmt: skip

    def _unknown_detail(self, hold_id: str) -> str:
        record = self._released.get(hold_id)
        if record is not None:
            return f"hold_id {hold_id!r}: already released ({record.reason})"
        if hold_id in self._given_up:
            return f"hold_id {hold_id!r}: no such hold (given up by its engine before placed)"
        return f"hold_id {hold_id!r}: no such hold"

    def _expire_if_due(self, hold: Hold, now: float) -> bool:
        if hold.expires_at <= now:
            self._release(hold, "expired", now)
            return True
        return False

    def _extend(self, hold: Hold, deadline: float) -> None:
        if deadline > hold.expires_at:
            hold.expires_at = deadline
            self._deadlines.set(hold.hold_id, deadline)

    def _release(self, hold: Hold, reason: HoldReleaseReason, now: float) -> ReleasedHold:
        if hold.state is HoldState.CLAIMED:
            self._claimed_live -= 1
        hold.state = advance(hold.state, HoldState.RELEASED)  # a second release raises here
        hold.reason = reason
        hold.released_at = now
        del self._holds[hold.hold_id]
        self._deadlines.drop(hold.hold_id)
        if self._by_request.get(hold.request_id) == hold.hold_id:
            del self._by_request[hold.request_id]
        record = ReleasedHold(
            hold_id=hold.hold_id,
            request_id=hold.request_id,
            block_ids=hold.block_ids,
            reason=reason,
        )
        self._released.append(record)
        self.counters.released[reason] = self.counters.released.get(reason, 0) + 1
        logger.debug("hold %s (request %s) released: %s", hold.hold_id, hold.request_id, reason)
        return record
