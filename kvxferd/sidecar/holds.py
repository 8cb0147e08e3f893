"""The prefill side's record of pinned blocks: holds with leases, claims, notifications.

A hold pins a request's blocks until every expected decode reader has notified, the engine aborts
it, or its lease (extended by claims and heartbeats) runs out. Whatever the path and the order,
each hold is released exactly once, and each release is appended to a cursor-addressed feed the
engine polls to free its blocks.

Expiry is checked by every call that touches a hold, not only by the reaper: a hold whose deadline
has passed is released as ``expired`` by the first call that notices, so an expired hold can never
be claimed or read "successfully" because the reaper was late.

Time comes from an injected clock (seconds, default ``time.monotonic``); every method also takes
an explicit ``now``. Not thread-safe by design: the sidecar calls it from its asyncio loop only,
and every method is synchronous and short, so no lock is needed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from kvxferd.descriptors.geometry import check_request_ids
from kvxferd.errors import (
    ConfigError,
    DuplicateHoldError,
    HoldExpiredError,
    HoldRequestError,
    UnknownHoldError,
)
from kvxferd.sidecar.states import HoldState, advance
from kvxferd.wire import HoldReleaseReason, HoldRequest, Manifest, ReleasedHold, ReleasedHolds

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(slots=True, eq=False)
class Hold:
    """One live (or just released) hold; callers read it, only HoldTable changes it."""

    hold_id: str
    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    created_at: float
    expires_at: float
    """Clock time the lease (or the latest claim/heartbeat extension) ends."""
    state: HoldState = HoldState.HELD
    expected_readers: int = 1
    """Notifications that release the hold (several decode ranks may read one prefill rank)."""
    readers: set[str] = field(default_factory=set)
    """Readers that claimed the hold."""
    notified: set[str] = field(default_factory=set)
    """Readers whose completion notification arrived."""
    reason: HoldReleaseReason | None = None
    released_at: float | None = None
    version: int = 0
    """Bumped whenever ``expires_at`` moves; reaper heap entries of older versions are stale."""


@dataclass(slots=True, frozen=True)
class ClaimGrant:
    """What a successful claim returns (the fields of ``wire.ClaimResponse`` plus headroom)."""

    hold_id: str
    hold: Hold
    expires_at: float
    expected_readers: int
    headroom_s: float
    """Lease time that was left when the claim arrived (low values: leases too short)."""


class NotifyOutcome(Enum):
    """What a reader's completion notification did."""

    COUNTED = "counted"
    """Recorded; other readers are still expected."""
    RELEASED = "released"
    """It was the last expected reader; the hold is released as ``notified``."""
    DUPLICATE = "duplicate"
    """This reader had already notified; counted once."""
    EXPIRED = "expired"
    """The hold's deadline had passed; it is released as ``expired`` instead."""
    UNKNOWN = "unknown"
    """No live hold (never existed, or already released): ignored, counted."""


def _zero_by_reason() -> dict[str, int]:
    return {"notified": 0, "expired": 0, "aborted": 0}


@dataclass(slots=True)
class HoldCounters:
    """Monotonic counters the metrics layer reads (live holds: ``len(table)``)."""

    held: int = 0
    """Holds created."""
    claimed: int = 0
    """Holds that went from HELD to CLAIMED."""
    claims: int = 0
    """Claims granted (a hold read by several decode ranks counts one per claim)."""
    released: dict[str, int] = field(default_factory=_zero_by_reason)
    """Holds released, by reason."""
    notifications: int = 0
    """Notifications counted toward a release."""
    notifications_duplicate: int = 0
    """Repeated notifications from a reader that had already notified."""
    notifications_unknown: int = 0
    """Notifications for holds that do not exist (late after expiry, or bogus)."""


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
        released_log_size: int = 65536,
    ) -> None:
        for name, value in (
            ("default_lease_s", default_lease_s),
            ("max_lease_s", max_lease_s),
            ("max_claim_s", max_claim_s),
            ("released_log_size", released_log_size),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}: must be > 0, got {value!r}")
        if default_lease_s > max_lease_s:
            raise ConfigError(f"default_lease_s: {default_lease_s} exceeds max_lease_s")
        self.num_blocks = manifest.num_blocks
        self.num_groups = len(manifest.groups)
        self.default_lease_s = float(default_lease_s)
        self.max_lease_s = float(max_lease_s)
        self.max_claim_s = float(max_claim_s)
        self.counters = HoldCounters()
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        self._by_request: dict[str, str] = {}
        # (deadline, tie-breaker, hold_id, hold version at push); stale entries are skipped.
        self._heap: list[tuple[float, int, str, int]] = []
        self._tie = itertools.count()
        self._log: deque[tuple[int, ReleasedHold]] = deque(maxlen=released_log_size)
        self._recent: dict[str, ReleasedHold] = {}  # hold_id -> record, while still in _log
        self._cursor = 0
        self._claimed_live = 0

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

    def find_request(self, request_id: str) -> Hold | None:
        """The live hold of an engine request id, if any."""
        hold_id = self._by_request.get(request_id)
        return None if hold_id is None else self._holds[hold_id]

    def live(self) -> list[Hold]:
        """Every live hold (a snapshot list)."""
        return list(self._holds.values())

    def next_deadline(self) -> float | None:
        """Clock time of the earliest live deadline, or None when nothing is held."""
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # -- operations ------------------------------------------------------------------------------

    def hold(self, request: HoldRequest, now: float | None = None) -> Hold:
        """Pin a request's blocks for ``request.lease_s`` (default if None, capped by the max)."""
        now = self._now(now)
        check_request_ids(self.num_blocks, self.num_groups, request.block_ids, "block_ids")
        if request.num_tokens < 0:
            raise HoldRequestError("num_tokens", f"must be >= 0, got {request.num_tokens}")
        lease = self.default_lease_s
        if request.lease_s is not None:
            lease = min(_positive(request.lease_s, "lease_s"), self.max_lease_s)
        existing = self.find_request(request.request_id)
        if existing is not None and not self._expire_if_due(existing, now):
            raise DuplicateHoldError(
                "request_id", f"{request.request_id!r} already has live hold {existing.hold_id}"
            )
        hold_id = request.hold_id or secrets.token_hex(16)  # stand-in until issue 10's claim grace
        if request.hold_id and (hold_id in self._holds or hold_id in self._recent):
            raise DuplicateHoldError("hold_id", f"{hold_id!r} is already used")
        while hold_id in self._holds or hold_id in self._recent:
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
        self._push(hold)
        self.counters.held += 1
        return hold

    def claim(
        self,
        hold_id: str,
        reader: str,
        claim_s: float,
        expected_readers: int = 1,
        now: float | None = None,
    ) -> ClaimGrant:
        """Pin a hold while ``reader`` reads it: deadline becomes at least now + claim_s (capped).

        Several readers may claim the same hold (heterogeneous TP); the hold then waits for the
        largest ``expected_readers`` any of them announced.
        """
        now = self._now(now)
        claim_s = min(_positive(claim_s, "claim_s"), self.max_claim_s)
        if not reader:
            raise HoldRequestError("reader", "must be a non-empty reader name")
        if not (isinstance(expected_readers, int) and expected_readers >= 1):
            raise HoldRequestError("expected_readers", f"must be >= 1, got {expected_readers!r}")
        hold = self._live(hold_id, now)
        headroom = hold.expires_at - now
        if hold.state is HoldState.HELD:
            hold.state = advance(hold.state, HoldState.CLAIMED)
            self.counters.claimed += 1
            self._claimed_live += 1
        hold.readers.add(reader)
        hold.expected_readers = max(hold.expected_readers, expected_readers)
        self._extend(hold, now + claim_s)
        self.counters.claims += 1
        return ClaimGrant(
            hold_id=hold.hold_id,
            hold=hold,
            expires_at=hold.expires_at,
            expected_readers=hold.expected_readers,
            headroom_s=headroom,
        )

    def notify(self, hold_id: str, reader: str, now: float | None = None) -> NotifyOutcome:
        """Record that ``reader`` finished reading; release once every expected reader has."""
        now = self._now(now)
        hold = self._holds.get(hold_id)
        if hold is None:
            self.counters.notifications_unknown += 1
            logger.info("notification from %s for unknown hold %s ignored", reader, hold_id)
            return NotifyOutcome.UNKNOWN
        if self._expire_if_due(hold, now):
            return NotifyOutcome.EXPIRED
        if reader in hold.notified:
            self.counters.notifications_duplicate += 1
            return NotifyOutcome.DUPLICATE
        hold.notified.add(reader)
        self.counters.notifications += 1
        if len(hold.notified) >= hold.expected_readers:
            self._release(hold, "notified", now)
            return NotifyOutcome.RELEASED
        return NotifyOutcome.COUNTED

    def notify_request(
        self, request_id: str, reader: str, now: float | None = None
    ) -> NotifyOutcome:
        """``notify`` addressed by the engine's request id instead of the hold id."""
        hold_id = self._by_request.get(request_id)
        if hold_id is None:
            self.counters.notifications_unknown += 1
            logger.info("notification from %s for unknown request %s ignored", reader, request_id)
            return NotifyOutcome.UNKNOWN
        return self.notify(hold_id, reader, now)

    def abort(self, hold_id: str, now: float | None = None) -> ReleasedHold:
        """Release a hold at the engine's request (reason ``aborted``, or ``expired`` if it was)."""
        now = self._now(now)
        hold = self.get(hold_id)
        if self._expire_if_due(hold, now):
            return self._recent[hold_id]
        return self._release(hold, "aborted", now)

    def release(
        self, hold_id: str, reason: HoldReleaseReason, now: float | None = None
    ) -> ReleasedHold:
        """Release a live hold for ``reason`` (e.g. ``unregistered``, ``declined``)."""
        return self._release(self.get(hold_id), reason, self._now(now))

    def heartbeat(
        self, hold_ids: Iterable[str], extend_s: float, now: float | None = None
    ) -> tuple[list[str], list[str]]:
        """Push each live hold's deadline to at least now + extend_s (capped by max_lease_s).

        Returns (extended, missing); a hold already past its deadline is released as expired and
        reported missing, never revived.
        """
        now = self._now(now)
        extend_s = min(_positive(extend_s, "extend_s"), self.max_lease_s)
        extended: list[str] = []
        missing: list[str] = []
        for hold_id in dict.fromkeys(hold_ids):
            hold = self._holds.get(hold_id)
            if hold is None or self._expire_if_due(hold, now):
                missing.append(hold_id)
            else:
                self._extend(hold, now + extend_s)
                extended.append(hold_id)
        return extended, missing

    def reap(self, now: float | None = None) -> list[ReleasedHold]:
        """Release, in deadline order, every hold whose deadline is at or before ``now``."""
        now = self._now(now)
        heap = self._heap
        released: list[ReleasedHold] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._valid(entry):
                released.append(self._release(self._holds[entry[2]], "expired", now))
        return released

    def released_since(self, cursor: int, limit: int | None = None) -> ReleasedHolds:
        """Releases after ``cursor`` (oldest first, at most ``limit``) and the cursor to pass next.

        Cursors count releases from 1. A cursor older than the oldest entry kept means the feed
        overran (logged; those blocks were never reported). A cursor beyond the newest one
        (an engine talking to a restarted sidecar) restarts from the oldest entry kept.
        """
        if cursor < 0:
            raise HoldRequestError("cursor", f"must be >= 0, got {cursor}")
        if limit is not None and limit < 1:
            raise HoldRequestError("limit", f"must be >= 1, got {limit}")
        log = self._log
        if cursor > self._cursor:
            cursor = 0
        oldest = log[0][0] if log else self._cursor + 1
        if cursor < oldest - 1:
            logger.warning(
                "released feed overran: %d releases before cursor %d were dropped",
                oldest - 1 - cursor,
                oldest,
            )
        newer = self._cursor - max(cursor, oldest - 1)
        entries = list(itertools.islice(reversed(log), newer))
        entries.reverse()
        if limit is not None:
            entries = entries[:limit]
        return ReleasedHolds(
            holds=[record for _, record in entries],
            cursor=entries[-1][0] if entries else self._cursor,
        )

    # -- internals -------------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _live(self, hold_id: str, now: float) -> Hold:
        """The live hold, or UnknownHoldError / HoldExpiredError (releasing it if just expired)."""
        hold = self._holds.get(hold_id)
        if hold is None:
            record = self._recent.get(hold_id)
            if record is not None and record.reason == "expired":
                raise HoldExpiredError(f"hold_id {hold_id!r}: lease ended, blocks may be reused")
            raise UnknownHoldError(self._unknown_detail(hold_id))
        if self._expire_if_due(hold, now):
            raise HoldExpiredError(f"hold_id {hold_id!r}: lease ended, blocks may be reused")
        return hold

    def _unknown_detail(self, hold_id: str) -> str:
        record = self._recent.get(hold_id)
        if record is not None:
            return f"hold_id {hold_id!r}: already released ({record.reason})"
        return f"hold_id {hold_id!r}: no such hold"

    def _expire_if_due(self, hold: Hold, now: float) -> bool:
        if hold.expires_at <= now:
            self._release(hold, "expired", now)
            return True
        return False

    def _extend(self, hold: Hold, deadline: float) -> None:
        if deadline > hold.expires_at:
            hold.expires_at = deadline
            hold.version += 1
            self._push(hold)

    def _push(self, hold: Hold) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._holds) + 64:
            # Mostly stale entries (leases extended, holds released): rebuild from live holds.
            heap[:] = [
                (h.expires_at, next(self._tie), h.hold_id, h.version)
                for h in self._holds.values()
                if h is not hold
            ]
            heapq.heapify(heap)
        heapq.heappush(heap, (hold.expires_at, next(self._tie), hold.hold_id, hold.version))

    def _valid(self, entry: tuple[float, int, str, int]) -> bool:
        hold = self._holds.get(entry[2])
        return hold is not None and hold.version == entry[3]

    def _release(self, hold: Hold, reason: HoldReleaseReason, now: float) -> ReleasedHold:
        if hold.state is HoldState.CLAIMED:
            self._claimed_live -= 1
        hold.state = advance(hold.state, HoldState.RELEASED)  # a second release raises here
        hold.reason = reason
        hold.released_at = now
        del self._holds[hold.hold_id]
        if self._by_request.get(hold.request_id) == hold.hold_id:
            del self._by_request[hold.request_id]
        record = ReleasedHold(
            hold_id=hold.hold_id,
            request_id=hold.request_id,
            block_ids=hold.block_ids,
            reason=reason,
        )
        if len(self._log) == self._log.maxlen:
            self._recent.pop(self._log[0][1].hold_id, None)
        self._cursor += 1
        self._log.append((self._cursor, record))
        self._recent[hold.hold_id] = record
        self.counters.released[reason] = self.counters.released.get(reason, 0) + 1
        logger.debug("hold %s (request %s) released: %s", hold.hold_id, hold.request_id, reason)
        return record
