"""One small HTTP client per peer address, bounded (LRU) and closed when idle.

Claims, handshakes and heartbeats to a prefill sidecar used to share one httpx pool for every
peer; its connection scan grows with every peer's connections and cost 15-29% of a busy decode
sidecar's CPU (issue 11). Here each peer address has its own client (its own few keep-alive
connections), at most ``max_clients`` of them: the least recently used idle one is closed when
another is needed, and one unused for ``idle_s`` is closed by the next call that notices. A
client in use is never closed under its caller.

Each peer's client is ``lanes`` small httpx pools used in turn (kvxferd.lanes): one pool
rescans all its connections for every request that starts or ends, so 64 claims in flight to
one prefill rank over one 32-connection pool were again most of the decode sidecar's CPU
(scripts/bench_pulls.py, issue 11).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from kvxferd.lanes import Lanes

MAX_CLIENTS = 64
"""Peer clients kept at once (a decode rank reads from a few prefill ranks at a time)."""
IDLE_S = 120.0
"""A peer client unused this long is closed."""
CONNECTIONS_PER_PEER = 32
"""Connections one peer client may open (claims of concurrent pulls to one prefill rank)."""
LANES = 4
"""Pools per peer client; its connections are split evenly between them."""


@dataclass
class _Entry:
    lanes: Lanes[httpx.AsyncClient]
    used_at: float
    users: int = 0
    closing: bool = field(default=False)


class PeerClients:
    """Per-address ``httpx.AsyncClient`` objects (LRU-bounded, closed when idle)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        keepalive_s: float,
        max_clients: int = MAX_CLIENTS,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        lanes: int = LANES,
    ) -> None:
        self._timeout = timeout_s
        self._keepalive = keepalive_s
        self._max = max_clients
        self._idle = idle_s
        self._clock = clock
        self._lanes = lanes
        self._per_lane = max(1, CONNECTIONS_PER_PEER // lanes)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.opened = 0
        """Clients created so far (one per address, again after one was closed)."""

    def __len__(self) -> int:
        return len(self._entries)

    def _new(self) -> Lanes[httpx.AsyncClient]:
        self.opened += 1
        limits = httpx.Limits(
            max_connections=self._per_lane,
            max_keepalive_connections=self._per_lane,
            keepalive_expiry=self._keepalive,
        )
        return Lanes(lambda: httpx.AsyncClient(timeout=self._timeout, limits=limits), self._lanes)

    @asynccontextmanager
    async def client(self, address: str) -> AsyncIterator[httpx.AsyncClient]:
        """A client of ``address`` (its next lane) for the duration of one call."""
        now = self._clock()
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = _Entry(self._new(), now)
        else:
            self._entries.move_to_end(address)
        entry.users += 1
        entry.used_at = now
        try:
            await self._trim(now)
            yield entry.lanes.next()
        finally:
            entry.users -= 1
            entry.used_at = self._clock()
            if entry.closing and entry.users == 0:
                await _close(entry)

    async def _trim(self, now: float) -> None:
        """Close idle clients beyond the bound, or unused for ``idle_s`` (oldest first)."""
        for address, entry in list(self._entries.items()):
            over = len(self._entries) > self._max
            if not over and now - entry.used_at < self._idle:
                break  # LRU order: the rest were used more recently
            if entry.users:
                continue  # in use: closed later
            del self._entries[address]
            await _close(entry)

    async def close(self) -> None:
        """Close every client (those in use close when their call ends)."""
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            if entry.users:
                entry.closing = True
            else:
                await _close(entry)


async def _close(entry: _Entry) -> None:
    for client in entry.lanes.made():
        await client.aclose()
