"""The proxy's backend clients: each request borrows one for its whole life.

A client here is a transport with its own kept connections (``KeptTransport``). Sharing one pool
between all requests made every request scan every connection (httpcore did so whenever a
request started or ended), so its cost grew with the requests in flight; at 64 in flight that
scan was the proxy's largest cost (issue 11). Here a request takes an idle client (the most
recently used: its connections are warm), or a new one up to ``limit``, or past that the least
busy; so each client mostly serves one request, with one connection per backend it talks to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

SLOTS = 32
"""Most clients the proxy makes: past this many requests in flight, clients are shared."""

C = TypeVar("C")


class ClientSlots(Generic[C]):
    """Clients made by ``make`` when needed (at most ``limit``), lent one per request."""

    def __init__(self, make: Callable[[], C], limit: int = SLOTS) -> None:
        if limit < 1:
            raise ValueError(f"client slots: at least 1, got {limit}")
        self._make = make
        self._limit = limit
        self._idle: list[C] = []
        self._load: dict[C, int] = {}

    def take(self) -> C:
        """A client for one request; hand it back with ``give`` when the request is over."""
        if self._idle:
            client = self._idle.pop()
        elif len(self._load) < self._limit:
            client = self._make()
            self._load[client] = 0
        else:
            client = min(self._load, key=self._load.__getitem__)
        self._load[client] += 1
        return client

    def give(self, client: C) -> None:
        """``client``'s request is over (every response it opened is closed)."""
        left = self._load[client] = self._load[client] - 1
        if left == 0:
            self._idle.append(client)

    def busy(self) -> int:
        """Requests holding a client now."""
        return sum(self._load.values())

    def made(self) -> list[C]:
        """Every client made so far (to close them)."""
        return list(self._load)
