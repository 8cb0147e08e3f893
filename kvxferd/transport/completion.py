"""Completion of posted transfers, driven from the event loop: no thread waits on NIXL.

One task per poller asks NIXL about every awaited transfer (``check_xfer_state`` releases the
GIL and costs microseconds), yielding between rounds and backing off to a short cap while
nothing completes. Waiters await futures, so a stalled peer costs a poll per round, never a
thread, and never delays a transfer from another peer.

A new transfer gets a couple of rounds at once (one done in microseconds is seen then), a kick
the full spin: a pull's READ completes only once the prefill has taken its claim, whose answer
kicks the poller (kvxferd.sidecar.pulls), so spinning before that only took CPU from the
processes it waits on (about 15 rounds a pull, a sixth of the decode sidecar's CPU at
concurrency 1: issue 11, ``scripts/bench_control.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvxferd.aio import Wake
from kvxferd.errors import TransferTimeoutError
from kvxferd.transport.base import PostedRead
from kvxferd.transport.transfer import TransferState

SPIN_ROUNDS = 16
"""Rounds after a kick that only yield to the loop (what it announced is likely done)."""
FRESH_SPIN_ROUNDS = 2
"""Rounds after a new transfer that only yield to the loop (one done in µs is seen at once)."""
FIRST_SLEEP_S = 0.00005
"""First sleep once spinning is over; doubles each empty round (the loop rounds it up to 1 ms)."""
MAX_SLEEP_S = 0.002
"""Longest sleep between rounds: a transfer is seen done at most this late."""


class CompletionPoller:
    """Waits for transfers on the running loop; one polling task while anything is awaited."""

    def __init__(self) -> None:
        self._waiting: dict[PostedRead, list[asyncio.Future[TransferState]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._fresh = False  # a transfer was added or a kick came: restart the backoff
        self._spin = 0  # rounds left that only yield to the loop
        self._kicked = Wake()  # ends a backoff sleep early

    @property
    def waiting(self) -> int:
        """Transfers awaited right now."""
        return len(self._waiting)

    async def wait(self, transfer: PostedRead, deadline: float) -> TransferState:
        """Until ``transfer`` is DONE (returned), FAILED (its error raised) or ``deadline``
        (``time.monotonic()``) passed: TransferTimeoutError, the transfer stays POSTED."""
        state = transfer.poll()
        if state is TransferState.POSTED:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[TransferState] = loop.create_future()
            self._waiting.setdefault(transfer, []).append(fut)
            self._fresh = True
            self._spin = max(self._spin, FRESH_SPIN_ROUNDS)
            if self._task is None or self._task.done():
                self._task = loop.create_task(self._run(), name="kvxferd-completions")
            try:
                async with asyncio.timeout_at(deadline):  # loop.time() is time.monotonic()
                    state = await fut
            except TimeoutError:
                raise TransferTimeoutError(
                    f"{transfer!r} not done by its deadline "
                    f"({time.monotonic() - deadline:+.3f} s past it)"
                ) from None
            finally:
                self._drop(transfer, fut)
        if state is TransferState.FAILED:
            assert transfer.error is not None
            raise transfer.error
        return state

    @property
    def backing_off(self) -> bool:
        """Whether the polling task sleeps between rounds right now (a kick ends the sleep)."""
        return self._kicked.sleeping

    def kick(self) -> None:
        """Poll now and spin again: something that tends to come with a completion happened (a
        READ's claim answered; the peer progressed its side just before answering), so the
        next round should not wait out the backoff."""
        self._fresh = True
        self._spin = SPIN_ROUNDS
        self._kicked.set()

    def _drop(self, transfer: PostedRead, fut: asyncio.Future[TransferState]) -> None:
        futs = self._waiting.get(transfer)
        if futs is not None:
            with contextlib.suppress(ValueError):
                futs.remove(fut)
            if not futs:
                del self._waiting[transfer]

    async def _run(self) -> None:
        sleep = FIRST_SLEEP_S
        while self._waiting:
            if self._fresh:  # a kick between sleeps restarts the backoff; it cuts no later sleep
                self._fresh, sleep = False, FIRST_SLEEP_S
                self._kicked.clear()
            progressed = False
            for transfer, futs in list(self._waiting.items()):
                state = transfer.poll()
                if state is TransferState.POSTED:
                    continue
                progressed = True
                for fut in futs:
                    if not fut.done():
                        fut.set_result(state)
                self._waiting.pop(transfer, None)
            spinning = self._spin > 0
            if spinning:
                self._spin -= 1
            if progressed or spinning:
                await asyncio.sleep(0)
            else:
                await self._kicked.sleep(sleep)
                self._kicked.clear()
                sleep = min(sleep * 2, MAX_SLEEP_S)
        self._spin = 0  # a kick that came with nothing awaited announced nothing

    async def close(self) -> None:
        """Stop the polling task (waiters then time out at their deadlines)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
