"""A small HTTP/1.1 client for the peer API: keep-alive connections to one peer, no pool scan.

httpx costs about a millisecond of CPU per call, most of it in its connection pool's per-request
scans and anyio layers; a decode rank reading from 8 prefill ranks makes 8 claims per pull, and
those were most of the decode sidecar's CPU (scripts/bench_pulls.py, issue 11). This client
keeps its own connections on asyncio streams and leaves the protocol to h11 (the sans-I/O
HTTP/1.1 library under httpx and uvicorn): h11 writes the request and parses the answer, so a
malformed one is a PeerHTTPError and its connection is dropped. Bounded: ``limit`` connections
at once, heads of MAX_HEAD bytes, bodies of MAX_BODY, every call by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import h11

MAX_HEAD = 64 << 10
"""Bytes of a response's status line and headers."""
MAX_BODY = 256 << 20
"""Bytes of a response body (a handshake carries the peer's manifest)."""


class PeerHTTPError(ConnectionError):
    """The peer's answer was not HTTP/1.1 this client reads (its connection is dropped)."""


class _Stale(PeerHTTPError):
    """A kept connection was closed by the peer before any answer: safe to retry once."""


@dataclass(frozen=True)
class Reply:
    """A peer's answer: status and body."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        """The body as text (for error details)."""
        return self.content.decode(errors="replace")


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    http: h11.Connection = field(
        default_factory=lambda: h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    )

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (now - self.idle_since < keepalive_s and not self.reader.at_eof()
                and not self.writer.is_closing())  # fmt: skip

    def close(self) -> None:
        self.writer.close()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class PeerConnection:
    """Keep-alive HTTP/1.1 connections to one peer address, at most ``limit`` at once."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float,
        keepalive_s: float,
        limit: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self._timeout = timeout_s
        self._keepalive = keepalive_s
        self._clock = clock
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Conn] = []
        self.is_closed = False
        self.opened = 0
        """Connections opened so far."""

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Reply:
        """POST ``body`` to ``path``; the peer's reply (OSError or TimeoutError otherwise)."""
        request = h11.Request(
            method="POST",
            target=path,
            headers=[("Host", self.address), ("Content-Length", str(len(body))),
                     *headers.items()],
        )  # fmt: skip
        async with asyncio.timeout(self._timeout), self._slots:
            conn = self._take()
            if conn is not None:
                try:
                    return await self._exchange(conn, request, body)
                except _Stale:
                    pass  # closed by the peer while idle: it never saw this request
            return await self._exchange(await self._open(), request, body)

    def _take(self) -> _Conn | None:
        now = self._clock()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self._keepalive):
                return conn
            conn.close()
        return None

    async def _open(self) -> _Conn:
        host, port = _split(self.address)
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD)
        self.opened += 1
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, request: h11.Request, body: bytes) -> Reply:
        keep = False
        try:
            data = conn.http.send(request) + conn.http.send(h11.Data(body))
            data += conn.http.send(h11.EndOfMessage())
            try:
                conn.writer.write(data)
                await conn.writer.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Stale(f"{self.address}: connection closed before the request") from exc
            reply = await _read_reply(conn)
            keep = conn.http.our_state is h11.DONE and conn.http.their_state is h11.DONE
            if keep:
                conn.http.start_next_cycle()
            return reply
        except h11.ProtocolError as exc:
            raise PeerHTTPError(f"{self.address}: {exc}") from exc
        finally:
            if keep and not self.is_closed:
                conn.idle_since = self._clock()
                self._idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        """Close every kept connection (calls in progress close theirs when they end)."""
        self.is_closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()


async def _read_reply(conn: _Conn) -> Reply:
    """One response, parsed by h11 from what the connection reads."""
    status, chunks, size = -1, [], 0
    while True:
        event = conn.http.next_event()
        if event is h11.NEED_DATA:
            try:
                data = await conn.reader.read(1 << 16)
            except ConnectionResetError as exc:
                data, reset = b"", exc
            else:
                reset = None
            if not data and conn.http.their_state is h11.SEND_RESPONSE and not _started(conn):
                raise _Stale("peer closed the connection before answering") from reset
            conn.http.receive_data(data)  # b"": the peer closed
        elif isinstance(event, h11.InformationalResponse):
            continue
        elif isinstance(event, h11.Response):
            status = event.status_code
            length = dict(event.headers).get(b"content-length")
            if length is not None and int(length) > MAX_BODY:
                raise PeerHTTPError(f"answer body of {int(length)} B over {MAX_BODY} B")
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY:
                raise PeerHTTPError(f"answer body over {MAX_BODY} B")
            chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return Reply(status, b"".join(chunks))
        else:  # ConnectionClosed (or PAUSED, which a client never sees mid-answer)
            raise PeerHTTPError("connection closed mid-answer")


def _started(conn: _Conn) -> bool:
    """Whether any byte of an answer arrived (h11 buffers a partial head)."""
    return bool(conn.http.trailing_data[0])
