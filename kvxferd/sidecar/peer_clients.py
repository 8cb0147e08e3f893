"""One small HTTP client per peer address, bounded (LRU) and closed when idle.

Claims, handshakes and heartbeats to a prefill sidecar used to share one httpx pool for every
peer; its connection scan grows with every peer's connections and cost 15-29% of a busy decode
sidecar's CPU (issue 11). Here each peer address has its own client (its own few keep-alive
connections), at most ``max_clients`` of them: the least recently used idle one is closed when
another is needed, and one unused for ``idle_s`` is closed by the next call that notices. A
client in use is never closed under its caller.

The client is kvxferd.sidecar.peer_http's (HTTP/1.1 over asyncio streams, no pool scan): even
per-peer httpx pools cost about a millisecond of CPU per claim, and a decode rank reading from 8
prefill ranks makes 8 claims per pull (scripts/bench_pulls.py, issue 11). Where the peer serves
the framed peer API, the same entry also keeps one framed connection to it (every call in flight
shares it), closed with the entry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from kvxferd.frameconn import AsyncFrameConn
from kvxferd.sidecar.peer_http import PeerConnection, split_address

MAX_CLIENTS = 64
"""Peer clients kept at once (a decode rank reads from a few prefill ranks at a time)."""
IDLE_S = 120.0
"""A peer client unused this long is closed."""
CONNECTIONS_PER_PEER = 32
"""Connections one peer client may open (claims of concurrent pulls to one prefill rank)."""
CONNECT_S = 1.0
"""Longest wait to open a framed connection (then the call goes over HTTP: kvxferd.sidecar.peers
says for how long the next ones do too)."""


@dataclass
class _Entry:
    client: PeerConnection
    used_at: float
    users: int = 0
    closing: bool = field(default=False)
    frames: AsyncFrameConn | None = None

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.frames is not None:
            await self.frames.aclose()


class PeerClients:
    """Per-address ``PeerConnection`` objects (LRU-bounded, closed when idle)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        keepalive_s: float,
        max_clients: int = MAX_CLIENTS,
        idle_s: float = IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout = timeout_s
        self._keepalive = keepalive_s
        self._max = max_clients
        self._idle = idle_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.opened = 0
        """Clients created so far (one per address, again after one was closed)."""

    def __len__(self) -> int:
        return len(self._entries)

    def _new(self, address: str) -> PeerConnection:
        self.opened += 1
        return PeerConnection(address, timeout_s=self._timeout, keepalive_s=self._keepalive,
                              limit=CONNECTIONS_PER_PEER, clock=self._clock)  # fmt: skip

    @asynccontextmanager
    async def client(self, address: str) -> AsyncIterator[PeerConnection]:
        """The client of ``address`` for the duration of one call."""
        async with self._use(address) as entry:
            yield entry.client

    @asynccontextmanager
    async def framed(self, address: str, port: int) -> AsyncIterator[AsyncFrameConn]:
        """The framed connection to ``address``'s host at ``port`` for the duration of one
        call (opened on first use; replaced if the peer now names another port)."""
        async with self._use(address) as entry:
            host, _ = split_address(address)
            if entry.frames is not None and entry.frames.tcp != (host, port):
                await entry.frames.aclose()
                entry.frames = None
            if entry.frames is None:
                entry.frames = AsyncFrameConn(
                    f"{host}:{port}", self._timeout, tcp=(host, port),
                    connect_timeout_s=min(self._timeout, CONNECT_S),
                )  # fmt: skip
            yield entry.frames

    @asynccontextmanager
    async def _use(self, address: str) -> AsyncIterator[_Entry]:
        now = self._clock()
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = _Entry(self._new(address), now)
        else:
            self._entries.move_to_end(address)
        entry.users += 1
        entry.used_at = now
        try:
            await self._trim(now)
            yield entry
        finally:
            entry.users -= 1
            entry.used_at = self._clock()
            if entry.closing and entry.users == 0:
                await entry.aclose()

    async def _trim(self, now: float) -> None:
        """Close idle clients beyond the bound, or unused for ``idle_s`` (oldest first)."""
        for address, entry in list(self._entries.items()):
            over = len(self._entries) > self._max
            if not over and now - entry.used_at < self._idle:
                break  # LRU order: the rest were used more recently
            if entry.users:
                continue  # in use: closed later
            del self._entries[address]
            await entry.aclose()

    async def close(self) -> None:
        """Close every client (those in use close when their call ends)."""
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            if entry.users:
                entry.closing = True
            else:
                await entry.aclose()
