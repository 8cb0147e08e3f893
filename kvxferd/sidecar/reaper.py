"""The reaper: the background task that expires hold leases and claims in deadline order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvxferd.sidecar.holds import REAP_SLICE, HoldTable

MAX_SLEEP_S = 1.0
"""Longest sleep between two looks at the table (a new registration's table is seen by then)."""


async def reap(table: Callable[[], HoldTable | None], after_release: Callable[[], None]) -> None:
    """Expire leases of ``table()`` (the current registration's holds, None while there is
    none) in deadline order, calling ``after_release`` after each slice; sleeps until the next
    deadline (at most ``MAX_SLEEP_S``). Runs until cancelled."""
    while True:
        if (holds := table()) is not None:
            # In slices: 100k holds expiring together never stall the loop for long.
            while len(holds.reap(max_items=REAP_SLICE)) == REAP_SLICE:
                after_release()
                await asyncio.sleep(0)
                if (holds := table()) is None:
                    break
            after_release()
        nxt = holds.next_deadline() if (holds := table()) is not None else None
        delay = MAX_SLEEP_S if nxt is None else max(0.0, nxt - time.monotonic())
        await asyncio.sleep(min(delay, MAX_SLEEP_S) + 0.001)


__all__ = ["MAX_SLEEP_S", "reap"]
