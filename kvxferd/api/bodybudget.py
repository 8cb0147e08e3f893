"""The bytes of request bodies one API holds in memory at once, across all its connections.

Each body is bounded (``max_body_bytes``) and so are the connections, but their product is not
a bound a sidecar survives: 1024 peer connections each sending a 16 MiB body would pin 16 GiB.
Each listener takes a body's bytes from its API's :class:`BodyBudget` before it reads them
(:class:`~kvxferd.api.limits.BodyLimit` for HTTP, :mod:`kvxferd.api.frames` for frames) and
gives them back once the call has answered; a body that finds no room waits, unread in the
socket, for as long as its caller's timeout allows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from kvxferd.errors import CapacityError

SETTING = "max_body_bytes_in_flight"
"""The setting that sizes the sidecar's budgets (named by refusals)."""
DEFAULT_BODIES = 4
"""Largest bodies a budget holds at once where no total is set (the front doors')."""


class BodyBudget:
    """A byte total shared by the requests of one API: :meth:`take` waits, first come first
    served, until the bytes are free; :meth:`give` returns them. The bytes taken never exceed
    ``total``. Waits are bounded by the caller (``asyncio.timeout``); a waiter cancelled or
    timed out holds nothing and does not hold up the waiters behind it.

    ``observe`` is called with the bytes taken after every change (a gauge's ``set``)."""

    def __init__(self, total: int, observe: Callable[[int], None] | None = None) -> None:
        if total <= 0:
            raise ValueError(f"a body budget needs a positive total, got {total}")
        self.total = total
        self.taken = 0
        self._observe = observe
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Takes waiting for room now."""
        return sum(1 for _, fut in self._waiters if not fut.done())

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes are free (after every earlier waiter), then hold them.
        CapacityError at once for more than the whole total: no wait would ever end."""
        if n > self.total:
            raise CapacityError(
                SETTING, f"a {n}-byte body is larger than the {self.total} bytes of this API"
            )
        if n <= 0:
            return
        if not self._waiters and self.taken + n <= self.total:
            self._add(n)
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.give(n)  # granted, then cancelled before it could run: hand them back
            else:
                with contextlib.suppress(ValueError):  # already dropped by _grant
                    self._waiters.remove(entry)
                self._grant()  # a large waiter leaving may let smaller ones behind it in
            raise

    def give(self, n: int) -> None:
        """Return ``n`` bytes taken earlier, and let waiters in, in order."""
        if n <= 0:
            return
        if n > self.taken:
            raise ValueError(f"giving back {n} bytes, but only {self.taken} are taken")
        self._add(-n)
        self._grant()

    def _grant(self) -> None:
        """Hand free bytes to the waiters at the head of the queue, in order."""
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled while queued
                self._waiters.popleft()
                continue
            if self.taken + n > self.total:
                return  # first come, first served: nobody overtakes the head
            self._waiters.popleft()
            self._add(n)
            fut.set_result(None)

    def _add(self, n: int) -> None:
        self.taken += n
        if self._observe is not None:
            self._observe(self.taken)
