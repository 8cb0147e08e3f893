"""Claims that arrived before their hold: the scheduler mints a ticket for an engine-chosen hold
id and the worker places the hold in the same engine step, so a fast decode's claim may come
first. It waits (briefly, bounded in time and in number) for the hold to be placed."""

from __future__ import annotations

import asyncio
import contextlib

MAX_WAITING = 4096
"""Hold ids waited for at once; a claim beyond that is answered at once (404 if not placed)."""


class Placements:
    """Hold ids that claims wait for, each with an event the hold's placement sets."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self._waiting: dict[str, tuple[asyncio.Event, list[int]]] = {}  # id -> (event, [users])
        self._max = max_waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def placed(self, hold_id: str) -> None:
        """The hold ``hold_id`` is live now (or will never be: its engine gave it up): wake the
        claims waiting for it."""
        entry = self._waiting.get(hold_id)
        if entry is not None:
            entry[0].set()

    async def wait(self, hold_id: str, grace_s: float) -> None:
        """Return once ``hold_id`` is placed or ``grace_s`` passed (at once when too many
        ids are waited for already)."""
        entry = self._waiting.get(hold_id)
        if entry is None:
            if len(self._waiting) >= self._max:
                return
            entry = self._waiting[hold_id] = (asyncio.Event(), [0])
        event, users = entry
        users[0] += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), grace_s)
        finally:
            users[0] -= 1
            if users[0] == 0 and self._waiting.get(hold_id) is entry:
                del self._waiting[hold_id]
