"""Lanes: a few small httpx clients used in turn instead of one large one.

httpcore's connection pool rescans every connection for every waiting request each time a
request starts or ends, so one client carrying N requests at once costs O(N^2) per request: at
64 in flight it was most of the proxy's and the sims' CPU (issue 11). Spread over ``n`` lanes,
each pool sees about N/n requests and connections. Lanes are created on first use, share one
SSL context (each new one loads the CA bundle: tens of milliseconds), each call goes to the next
lane in turn, and all are closed together.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from typing import Generic, TypeVar

import httpx

C = TypeVar("C", httpx.Client, httpx.AsyncClient)

ASYNC_LANES = 8
"""Lanes of an asyncio client: 64 requests in flight make about 8 per pool."""


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The verifying SSL context every lane of this process shares."""
    return httpx.create_ssl_context()


class Lanes(Generic[C]):
    """``n`` clients made by ``make`` when first needed, handed out round robin."""

    def __init__(self, make: Callable[[], C], n: int) -> None:
        if n < 1:
            raise ValueError(f"lanes: at least 1, got {n}")
        self._make = make
        self._clients: list[C | None] = [None] * n
        self._next = 0

    def __len__(self) -> int:
        return len(self._clients)

    def next(self) -> C:
        """The client of the next lane (made now if it is the lane's first call)."""
        i = self._next
        self._next = (i + 1) % len(self._clients)
        client = self._clients[i]
        if client is None:
            client = self._clients[i] = self._make()
        return client

    def made(self) -> list[C]:
        """The clients made so far (to close them)."""
        return [c for c in self._clients if c is not None]
