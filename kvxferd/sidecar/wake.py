"""A wake-up flag a polling loop sleeps on with a timeout, at the cost of one future and one
timer per sleep.

The prefill sidecar's notification poller sleeps up to 1,000 times a second while holds are
claimed; ``asyncio.wait_for(event.wait(), t)`` made a task per sleep and raised on every
timeout, most of the poller's CPU at prefill TP 8 (scripts/bench_pulls.py, issue 11).
Loop-thread only, like ``asyncio.Event``.
"""

from __future__ import annotations

import asyncio


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Wake:
    """``set`` wakes a sleeping ``sleep`` early; the flag stays set until ``clear``."""

    def __init__(self) -> None:
        self._set = False
        self._sleeper: asyncio.Future[bool] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        fut = self._sleeper
        if fut is not None and not fut.done():
            fut.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def sleep(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; whether the flag was (or got) set."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, fut)
        self._sleeper = fut
        try:
            return await fut
        finally:
            timer.cancel()
            self._sleeper = None
