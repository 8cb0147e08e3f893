"""The proxy's backend clients: each request borrows one httpx client for its whole life.

httpcore's pool rescans every connection for every waiting request whenever a request starts or
ends (and polls each idle socket to see whether it is still open), so its cost per request grows
with the requests sharing a pool. Round-robin lanes still put 8 requests and 16 connections in
each pool at 64 in flight; there that scan was the proxy's largest cost and the proxy
saturated a core before the backends did (issue 11). Here a request takes an idle client (the
most recently used: its connections are warm), or a new one up to ``limit``, or past that the
least busy; so each pool mostly holds one request and one connection per backend it talks to.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

SLOTS = 32
"""Most clients the proxy makes: past this many requests in flight, clients are shared."""


class ClientSlots:
    """httpx clients made by ``make`` when needed (at most ``limit``), lent one per request."""

    def __init__(self, make: Callable[[], httpx.AsyncClient], limit: int = SLOTS) -> None:
        if limit < 1:
            raise ValueError(f"client slots: at least 1, got {limit}")
        self._make = make
        self._limit = limit
        self._idle: list[httpx.AsyncClient] = []
        self._load: dict[httpx.AsyncClient, int] = {}

    def take(self) -> httpx.AsyncClient:
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

    def give(self, client: httpx.AsyncClient) -> None:
        """``client``'s request is over (every response it opened is closed)."""
        left = self._load[client] = self._load[client] - 1
        if left == 0:
            self._idle.append(client)

    def busy(self) -> int:
        """Requests holding a client now."""
        return sum(self._load.values())

    def made(self) -> list[httpx.AsyncClient]:
        """Every client made so far (to close them)."""
        return list(self._load)
