"""A small HTTP/1.1 client for the peer API: keep-alive connections to one peer, no pool scan.

httpx costs about a millisecond of CPU per call, most of it in its connection pool's per-request
scans and anyio layers; a decode rank reading from 8 prefill ranks makes 8 claims per pull, and
those were most of the decode sidecar's CPU (scripts/bench_pulls.py, issue 11). A peer call is
one short signed POST answered with a ``Content-Length`` body, so this client writes the
request in one write, reads the status line, the headers and exactly that many bytes, and keeps
the connection for the next call. Anything else (chunked or unsized bodies, oversized heads,
malformed lines) is a PeerHTTPError and the connection is dropped. Bounded: ``limit``
connections at once, heads of MAX_HEAD bytes, bodies of MAX_BODY, every call by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
        head = [f"POST {path} HTTP/1.1", f"Host: {self.address}",
                f"Content-Length: {len(body)}"]  # fmt: skip
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        async with asyncio.timeout(self._timeout), self._slots:
            conn = self._take()
            if conn is not None:
                try:
                    return await self._exchange(conn, request)
                except _Stale:
                    pass  # closed by the peer while idle: it never saw this request
            return await self._exchange(await self._open(), request)

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

    async def _exchange(self, conn: _Conn, request: bytes) -> Reply:
        keep = False
        try:
            try:
                conn.writer.write(request)
                await conn.writer.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Stale(f"{self.address}: connection closed before the request") from exc
            reply, keep = await _read_reply(conn.reader)
            return reply
        except asyncio.IncompleteReadError as exc:
            raise PeerHTTPError(f"{self.address}: connection closed mid-answer") from exc
        except asyncio.LimitOverrunError as exc:
            raise PeerHTTPError(f"{self.address}: answer head over {MAX_HEAD} B") from exc
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


async def _read_reply(reader: asyncio.StreamReader) -> tuple[Reply, bool]:
    """One response: (reply, whether the connection may be kept)."""
    try:
        line = await reader.readuntil(b"\r\n")
    except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
        if isinstance(exc, ConnectionResetError) or not exc.partial:
            raise _Stale("peer closed the connection before answering") from exc
        raise
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise PeerHTTPError(f"not an HTTP/1.1 status line: {line[:80]!r}")
    status = int(parts[1])
    length, keep, size = -1, parts[0] == b"HTTP/1.1", len(line)
    while True:
        line = await reader.readuntil(b"\r\n")
        size += len(line)
        if size > MAX_HEAD:
            raise PeerHTTPError(f"answer head over {MAX_HEAD} B")
        if line == b"\r\n":
            break
        name, sep, value = line.partition(b":")
        if not sep:
            raise PeerHTTPError(f"malformed header line {line[:80]!r}")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                raise PeerHTTPError(f"bad content-length {value[:40]!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            raise PeerHTTPError(f"unsupported transfer-encoding {value[:40]!r}")
        elif name == b"connection":
            keep = keep and value != b"close"
    if length < 0:
        if status in (204, 304) or 100 <= status < 200:
            length = 0
        else:
            raise PeerHTTPError(f"answer {status} without content-length")
    if length > MAX_BODY:
        raise PeerHTTPError(f"answer body of {length} B over {MAX_BODY} B")
    body = await reader.readexactly(length) if length else b""
    return Reply(status, body), keep
