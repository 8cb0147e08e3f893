"""One pull's record on the decode side: its state, outcome and byte counts, and its wire
views (status, finished-feed entry). ``PullRunner`` (kvxferd.sidecar.pulls) drives it."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from kvxferd.sidecar.states import PullState, advance
from kvxferd.wire import FinishedPull, Manifest, PullRequest, PullStatus


@dataclass
class Pull:
    """One pull's record; ``done`` is set when it reaches DONE or FAILED."""

    pull_id: str
    request: PullRequest | None
    """The engine's request while the pull runs; dropped once it ended (its status needs none
    of it, and up to ``pulls._KEEP_FINISHED`` finished pulls are kept)."""
    started: float = field(default_factory=time.monotonic)
    ends_by: float = math.inf
    """Monotonic time the pull ends by: its deadline, counted from the engine's call when the
    call said when that was (``not_after_ns``), never from a late arrival."""
    state: PullState = PullState.PENDING
    reason: str = ""
    detail: str = ""
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    duration_s: float = 0.0
    unsettled: str = ""  # why a READ could not be confirmed stopped: this reason wins
    validated: Manifest | None = None  # the registration validate_pull checked the ids against
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def advance(self, new: PullState) -> None:
        """Move forward through ``states.advance``; a live state another rank of this pull
        already passed is no move (ranks progress concurrently). Out of DONE/FAILED raises."""
        if not self.state.terminal and not new.terminal and new <= self.state:
            return
        self.state = advance(self.state, new)

    def fail(self, reason: str, detail: str) -> None:
        """End FAILED with a reason code (StateError if it had already ended)."""
        self.advance(PullState.FAILED)
        self.reason, self.detail = reason, detail

    def finished(self) -> FinishedPull:
        """The finished-feed entry of an ended pull: its local ids are invalid unless DONE."""
        req = self.request
        assert req is not None  # dropped only after this entry was made
        done = self.state is PullState.DONE
        return FinishedPull(
            pull_id=self.pull_id,
            request_id=req.request_id,
            state="done" if done else "failed",
            reason=self.reason,
            failed_block_ids=[] if done else [[b for b in g if b >= 0] for g in req.block_ids],
        )

    def status(self) -> PullStatus:
        """The wire view."""
        return PullStatus(
            pull_id=self.pull_id,
            state=self.state.wire_name,
            reason=self.reason,
            detail=self.detail,
            kv_bytes=self.kv_bytes,
            state_bytes=self.state_bytes,
            descriptors=self.descriptors,
            duration_s=self.duration_s,
        )


__all__ = ["Pull"]
