"""One hold and what HoldTable's calls answer about it (kvxferd.sidecar.holds has the rules).

A ``Hold`` is read by anyone and changed only by its HoldTable. A reader may claim a hold more
than once (the same tickets pulled twice): ``Hold.reading`` counts each reader's claims not
notified yet, so its first notification cannot end the hold under its second READ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvxferd.errors import HoldExpiredError
from kvxferd.sidecar.states import HoldState
from kvxferd.wire import HoldReleaseReason

__all__ = ["ClaimGrant", "DeclineOutcome", "Hold", "HoldCounters", "NotifyOutcome"]


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
    reading: dict[str, int] = field(default_factory=dict)
    """Each reader that claimed the hold: its claims not notified yet (two READs: two claims)."""
    reason: HoldReleaseReason | None = None
    released_at: float | None = None
    reader_tp_size: int = 0
    """Decode TP size the first claim announced (0 until claimed); later claims must agree."""
    claimed_until: float = 0.0
    """When the latest claim ends (no reader reads past it); 0 until claimed."""
    aborted: HoldReleaseReason | None = None
    """Why the engine gave it up while claimed (``aborted``, ``unregistered``): released for
    that reason once its readers are done (see abort); None while it has not."""

    @property
    def readers(self) -> set[str]:
        """Readers that claimed the hold."""
        return set(self.reading)

    @property
    def notified(self) -> set[str]:
        """Readers whose every claim has notified."""
        return {r for r, n in self.reading.items() if not n}

    def pinned(self, now: float) -> None:
        """HoldExpiredError unless its engine still keeps the blocks unchanged (not released,
        lease not ended): bytes copied out of them before this passed were the held ones."""
        if self.reason is not None or self.expires_at <= now:
            raise HoldExpiredError(f"hold {self.hold_id}: let go ({self.reason or 'expired'}); "
                                   f"its blocks may be reused")  # fmt: skip


@dataclass(slots=True, frozen=True)
class ClaimGrant:
    """What a successful claim returns (the fields of ``wire.ClaimResponse`` plus headroom)."""

    hold_id: str
    hold: Hold
    expires_at: float
    expected_readers: int
    headroom_s: float
    """Lease time that was left when the claim arrived (low values: leases too short)."""
    granted_s: float = 0.0
    """How long this claim pins the hold from now (the request's claim_s, capped)."""


class NotifyOutcome(Enum):
    """What a reader's completion notification did."""

    COUNTED = "counted"
    """Recorded; other readers (or this reader's other claims) are still expected."""
    RELEASED = "released"
    """It was the last expected reader; the hold is released as ``notified``."""
    DUPLICATE = "duplicate"
    """This reader had already notified; counted once."""
    ABORTED = "aborted"
    """The engine had given the hold up and this was the last reader still reading: released as
    ``aborted`` (or ``unregistered``)."""
    EXPIRED = "expired"
    """The hold's deadline had passed; it is released as ``expired`` instead."""
    UNKNOWN = "unknown"
    """No live hold (never existed, or already released): ignored, counted."""


def _zero_by_reason() -> dict[str, int]:
    return {"notified": 0, "expired": 0, "aborted": 0, "declined": 0, "unregistered": 0}


class DeclineOutcome(Enum):
    """What a decode side's decline did to one hold."""

    RELEASED = "released"
    """Released now as ``declined``."""
    MISSING = "missing"
    """No live hold with those block ids (already released, expired, or another hold)."""
    BUSY = "busy"
    """A reader has claimed it and may be reading: left to notifications or expiry."""


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
