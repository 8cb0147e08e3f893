"""The proxy's HTTP/1.1 transport under httpx: kept connections per origin, one write a request.

httpcore (httpx's default) writes a request's head and body separately, so the backend's server
wakes twice per call on loopback, and runs every call through anyio and its pool's scans; at
concurrency 1 the proxy spent a third of its time in socket sends (issue 11). Here h11 (the
sans-I/O HTTP/1.1 library under httpx and uvicorn) frames the request, which goes out in one
write on an asyncio stream kept per origin (most recently used first); the answer streams back
as an httpx.Response, so the proxy's code, its phase timeouts and its errors stay httpx's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import h11
import httpx

MAX_HEAD = 64 << 10
"""Bytes of a backend answer's status line and headers."""
_READ = 1 << 16

Origin = tuple[str, str, int]


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


class _Stale(httpx.RemoteProtocolError):
    """A kept connection was closed by the backend before any answer: safe to retry once."""


class KeptTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to any origin; at most ``keepalive`` idle connections kept per origin."""

    def __init__(
        self, ssl_context: ssl.SSLContext, keepalive: int = 16, keepalive_s: float = 4.0
    ) -> None:
        self._ssl = ssl_context
        self._keepalive = keepalive
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Conn]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin: Origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        body = b"".join([chunk async for chunk in request.stream])  # type: ignore[union-attr]
        target = url.raw_path
        head = h11.Request(method=request.method, target=target, headers=request.headers.raw)
        timeouts = request.extensions.get("timeout", {})
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, request, head, body, timeouts)
            except _Stale:
                pass  # closed while idle: the backend never saw this request
        conn = await self._open(origin, request, timeouts.get("connect"))
        return await self._exchange(origin, conn, request, head, body, timeouts)

    def _take(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self._keepalive_s):
                return conn
            conn.close()
        return None

    def _give(self, origin: Origin, conn: _Conn) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self._keepalive:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def _open(self, origin: Origin, request: httpx.Request, timeout: float | None) -> _Conn:
        scheme, host, port = origin
        tls = self._ssl if scheme == "https" else None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=host if tls else None, limit=MAX_HEAD
                )
        except TimeoutError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return _Conn(reader, writer)

    async def _exchange(
        self, origin: Origin, conn: _Conn, request: httpx.Request, head: h11.Request,
        body: bytes, timeouts: dict[str, float | None],
    ) -> httpx.Response:  # fmt: skip
        done = False
        try:
            data = conn.http.send(head)
            if body:
                data += conn.http.send(h11.Data(body))
            data += conn.http.send(h11.EndOfMessage())
            try:
                conn.writer.write(data)
                async with asyncio.timeout(timeouts.get("write")):
                    await conn.writer.drain()
            except TimeoutError:
                raise httpx.WriteTimeout("write timed out", request=request) from None
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Stale("connection closed before the request", request=request) from exc
            event = await _answer_head(conn, request)
            done = True
        except h11.ProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        finally:
            if not done:
                conn.close()
        return httpx.Response(
            event.status_code,
            headers=event.headers.raw_items(),
            stream=_Body(self, origin, conn, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": event.reason},
        )

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
        for conns in idle.values():
            for conn in conns:
                with contextlib.suppress(OSError):
                    await conn.writer.wait_closed()


async def _answer_head(conn: _Conn, request: httpx.Request) -> h11.Response:
    """The backend's status line and headers (1xx skipped)."""
    while True:
        event = conn.http.next_event()
        if event is h11.NEED_DATA:
            data = await conn.reader.read(_READ)
            if not data and not conn.http.trailing_data[0]:
                raise _Stale("backend closed the connection before answering", request=request)
            conn.http.receive_data(data)
        elif isinstance(event, h11.Response):
            return event
        elif not isinstance(event, h11.InformationalResponse):
            raise httpx.RemoteProtocolError("connection closed before an answer", request=request)


class _Body(httpx.AsyncByteStream):
    """An answer's body as it arrives; its connection is kept once the body ended cleanly."""

    def __init__(
        self, transport: KeptTransport, origin: Origin, conn: _Conn, request: httpx.Request
    ) -> None:
        self._transport, self._origin, self._conn = transport, origin, conn
        self._request = request
        self._finished = self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                event = conn.http.next_event()
                if event is h11.NEED_DATA:
                    conn.http.receive_data(await conn.reader.read(_READ))
                elif isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self._finished = True
                    return
                else:
                    raise httpx.RemoteProtocolError("connection closed mid-answer",
                                                    request=self._request)  # fmt: skip
        except h11.ProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn, http = self._conn, self._conn.http
        if self._finished and http.our_state is h11.DONE and http.their_state is h11.DONE:
            http.start_next_cycle()
            self._transport._give(self._origin, conn)
        else:
            conn.close()
