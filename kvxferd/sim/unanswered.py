"""Holds the sim may have placed without knowing it: a hold call that got no answer, whose abort
got none either. The sidecar may have placed the hold (the call reached it) and a decode may be
reading its blocks, so they stay the request's until the sidecar says: a later abort it answers
(not placed: freed now; placed: the released feed frees them), or its released feed. Retried
every ``retry_s``; after ``bound_s`` without an answer the blocks are freed all the same (counted
and logged), so a sidecar that never answers again leaks nothing for ever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import httpx

from kvxferd.client import AsyncEngineClient
from kvxferd.errors import HoldExpiredError, KvxferdError, NotRegisteredError, UnknownHoldError

log = logging.getLogger(__name__)
Outcome = Literal["placed", "unplaced", "unknown"]


def placed_maybe(exc: BaseException) -> bool:
    """Whether the hold whose call raised ``exc`` may have been placed all the same: anything but
    an answer refusing it (a 4xx)."""
    status = getattr(exc, "status", None)
    return not (isinstance(status, int) and 400 <= status < 500)


async def confirm(client: AsyncEngineClient, hold_id: str) -> Outcome:
    """Abort ``hold_id`` and say what the answer tells of it: ``placed`` (given up now; the
    released feed reports it once its readers are done), ``unplaced`` (never placed, and a hold
    call with it arriving later is refused; or its registration is gone), or ``unknown``."""
    try:
        await client.abort(hold_id)
    except (UnknownHoldError, NotRegisteredError):
        return "unplaced"
    except HoldExpiredError:
        return "placed"
    except (KvxferdError, httpx.HTTPError, TimeoutError) as exc:
        log.debug("abort of hold %s got no usable answer: %s", hold_id, exc)
        return "unknown"
    return "placed"


async def abort_placement(
    clients: Sequence[AsyncEngineClient], results: Sequence[object], hold_ids: Sequence[str]
) -> tuple[set[int], list[int]]:
    """Abort a placement some rank failed, on every rank (where it was not placed too: a later
    hold call is refused). The ranks whose blocks stay held: those that placed it, and those
    that gave no answer (they may have placed it, and a decode may read it) unless the abort
    says they did not; and, of those, the ranks whose abort got no answer either (to retry)."""
    keep = {r for r, t in enumerate(results) if not isinstance(t, BaseException)}
    unanswered = []
    for rank, client in enumerate(clients):
        outcome = await confirm(client, hold_ids[rank])
        failed = results[rank]
        if rank in keep or not isinstance(failed, BaseException) or not placed_maybe(failed):
            continue
        if outcome != "unplaced":
            keep.add(rank)
        if outcome == "unknown":
            unanswered.append(rank)
    return keep, unanswered


@dataclass
class _Entry:
    request_id: str
    rank: int
    hold_id: str
    since: float


class UnansweredHolds:
    """Aborts retried until the sidecar answers them; ``settle(request_id, rank)`` when a rank
    no longer holds the request's blocks (never placed there, or the bound passed)."""

    def __init__(
        self, clients: Sequence[AsyncEngineClient], settle: Callable[[str, int], None], *,
        retry_s: float, bound_s: float, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._clients = clients
        self._settle = settle
        self.retry_s = retry_s
        self.bound_s = bound_s
        self._clock = clock
        self._entries: list[_Entry] = []
        self._wake = asyncio.Event()
        self.abandoned = 0
        """Entries given up after ``bound_s`` without an answer (their blocks freed)."""

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, rank: int, hold_id: str) -> None:
        """Retry the abort of ``rank``'s hold of ``request_id`` until the sidecar answers."""
        log.warning("hold %s of request %s: rank %d's sidecar answered neither the hold nor its "
                    "abort; its blocks wait for an answer (at most %g s)", hold_id, request_id,
                    rank, self.bound_s)  # fmt: skip
        self._entries.append(_Entry(request_id, rank, hold_id, self._clock()))
        self._wake.set()

    async def run(self) -> None:
        """Retry every ``retry_s`` while there are entries (a task, cancelled at close)."""
        while True:
            if not self._entries:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.retry_s)
            for entry in list(self._entries):
                outcome = await confirm(self._clients[entry.rank], entry.hold_id)
                if outcome == "unknown" and self._clock() - entry.since < self.bound_s:
                    continue
                self._entries.remove(entry)
                if outcome == "unplaced":
                    self._settle(entry.request_id, entry.rank)
                elif outcome == "unknown":
                    self.abandoned += 1
                    log.warning("hold %s of request %s: no answer from rank %d's sidecar for "
                                "%g s; its blocks are freed unconfirmed", entry.hold_id,
                                entry.request_id, entry.rank, self.bound_s)  # fmt: skip
                    self._settle(entry.request_id, entry.rank)
                # placed: given up now, the released feed frees its blocks
