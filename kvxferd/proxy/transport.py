"""The proxy's HTTP/1.1 transport under httpx: kept connections per origin, one write a request.

httpcore (httpx's default) writes a request's head and body separately, so the backend's server
wakes twice per call on loopback, and runs every call through anyio and its pool's scans; at
concurrency 1 the proxy spent a third of its time in socket sends (issue 11). Here a request
goes out in one write on an asyncio stream kept per origin (most recently used first), and its
answer is parsed by httptools (llhttp, the C parser uvicorn serves with; h11 cost 0.16 ms an
exchange here, httptools 0.01) and streams back as an httpx.Response, so the proxy's code, its
phase timeouts and its errors stay httpx's. Header names and values are checked before they are
written (no CR, LF or NUL: nothing a caller passes can add a header or a request).

A kept connection is retried once on a fresh one only where the backend cannot have acted on the
request: its write failed, or (GET and HEAD only) it closed before a byte of an answer. A POST
whose bytes went out is never sent twice (a second prefill hold nobody reads, a decode run
twice); a kept connection with anything to read (the backend's close) is not reused at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httptools
import httpx

MAX_HEAD = 64 << 10
"""Bytes of a backend answer's status line and headers."""
_READ = 1 << 16
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP method or header name (RFC 9110 token)."""
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_BAD_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_IDEMPOTENT = frozenset({"GET", "HEAD"})
"""Methods the proxy sends that a backend may see twice (its probes); never its POSTs."""
UNSENT = "kvxferd.unsent"
"""Request extension KeptTransport sets: True while the backend cannot have the request: until a
byte of it may have gone out, and again while a kept connection whose write failed is replaced
(another transport leaves it unset: nothing is known)."""

Origin = tuple[str, str, int]


class _Answer:
    """httptools' callbacks for one backend answer: its head, then its body as it is parsed.

    1xx answers are skipped; an answer with neither Content-Length nor chunked framing ends
    when the backend closes the connection (``until_close``)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.reason = b""
        self.status = 0
        self.head_done = self.done = self.extra = False
        self.keep_alive = False
        """The backend lets the connection carry another request (read at the answer's end)."""
        self.head_bytes = 0
        """Bytes fed while the head was incomplete (bounds what httptools buffers)."""
        self.head_size = 0
        """Bytes of the parsed status line and headers."""
        self.chunks: list[bytes] = []

    def feed(self, data: bytes, request: httpx.Request) -> None:
        """Parse ``data``; httptools' errors become httpx's. A head is at most MAX_HEAD bytes."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {exc}",
                                            request=request) from exc  # fmt: skip
        if not self.head_done:
            self.head_bytes += len(data)
        if self.head_size > MAX_HEAD or (not self.head_done and self.head_bytes > MAX_HEAD):
            raise httpx.RemoteProtocolError(f"answer head over {MAX_HEAD} bytes", request=request)

    @property
    def until_close(self) -> bool:
        """The body has no length of its own: it ends at EOF."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def take(self) -> bytes:
        """Body bytes parsed since the last take."""
        out, self.chunks = b"".join(self.chunks), []
        return out

    def on_message_begin(self) -> None:
        self.extra = self.extra or self.done  # bytes after the answer: the link is not reused

    def on_status(self, status: bytes) -> None:
        self.reason += status
        self.head_size += len(status) + 15

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self.head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = self.status >= 200

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))

    def on_message_complete(self) -> None:
        if self.status < 200:  # informational (100 Continue, 103): the real answer follows
            self.headers, self.reason, self.head_bytes, self.head_size = [], b"", 0, 0
            return
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()  # false again once the answer ended


def _request_head(request: httpx.Request) -> bytes:
    """The request line and headers, checked: a value with CR, LF or NUL is refused."""
    method, target = request.method.encode(), request.url.raw_path
    if not _TOKEN.fullmatch(method) or not target or _BAD_TARGET.search(target):
        raise httpx.LocalProtocolError(f"bad request line {method!r} {target!r}", request=request)
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise httpx.LocalProtocolError(f"header {name!r}: not a valid field", request=request)
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (now - self.idle_since < keepalive_s and not self.reader.at_eof()
                and not self.writer.is_closing() and not self._readable())  # fmt: skip

    def _readable(self) -> bool:
        """Bytes or the backend's close wait in the kernel (the loop has not read them yet): an
        idle HTTP/1.1 connection has nothing to say, so it is going away."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def close(self) -> None:
        self.writer.close()


class _Stale(httpx.RemoteProtocolError):
    """A kept connection failed before the backend could act on the request: retried once."""


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
        head = _request_head(request)
        timeouts = request.extensions.get("timeout", {})
        request.extensions[UNSENT] = True
        conn = self._take(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, request, head, body, timeouts)
            except _Stale:
                pass  # closed while idle: the backend did not act on this request
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
        self, origin: Origin, conn: _Conn, request: httpx.Request, head: bytes, body: bytes,
        timeouts: dict[str, float | None],
    ) -> httpx.Response:  # fmt: skip
        done = False
        answer = _Answer()
        try:
            try:
                request.extensions[UNSENT] = False
                conn.writer.write(head + body)
                async with asyncio.timeout(timeouts.get("write")):
                    await conn.writer.drain()
            except TimeoutError:
                raise httpx.WriteTimeout("write timed out", request=request) from None
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The write did not complete (below the buffer's high-water mark a completed
                # one returns at once): at most part of the request went out, never acted on.
                request.extensions[UNSENT] = True
                raise _Stale("connection closed before the request", request=request) from exc
            while not answer.head_done:
                data = await conn.reader.read(_READ)
                if not data:
                    if answer.head_bytes:
                        raise httpx.RemoteProtocolError("connection closed mid-head",
                                                        request=request)  # fmt: skip
                    # It may have closed before the request came, or after acting on it.
                    closed = _Stale if request.method in _IDEMPOTENT else httpx.RemoteProtocolError
                    raise closed("backend closed the connection before answering", request=request)
                answer.feed(data, request)
            done = True
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        finally:
            if not done:
                conn.close()
        return httpx.Response(
            answer.status,
            headers=answer.headers,
            stream=KeptBody(self, origin, conn, answer, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": answer.reason},
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


class KeptBody(httpx.AsyncByteStream):
    """An answer's body as it arrives; its connection is kept once the body ended cleanly."""

    def __init__(
        self, transport: KeptTransport, origin: Origin, conn: _Conn, answer: _Answer,
        request: httpx.Request,
    ) -> None:  # fmt: skip
        self._transport, self._origin, self._conn = transport, origin, conn
        self._answer, self._request = answer, request
        self._finished = self._closed = self._iterated = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self._iterated = True
        answer, reader = self._answer, self._conn.reader
        try:
            while True:
                if chunk := answer.take():
                    yield chunk
                if answer.done:
                    self._finished = True
                    return
                data = await reader.read(_READ)
                if not data:
                    if answer.until_close:  # the body's end is the connection's
                        answer.done = answer.extra = True
                        continue
                    raise httpx.RemoteProtocolError("connection closed mid-answer",
                                                    request=self._request)  # fmt: skip
                answer.feed(data, self._request)
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self._request) from exc

    def arrived(self) -> bytes | None:
        """The whole body if it has all arrived with the head (a small answer usually does) and
        nothing of it was taken yet, else None: then read it by iterating. Skips httpx's layers
        of async generators, a few dozen microseconds a call (issue 11)."""
        answer = self._answer
        if self._iterated or self._finished or self._closed or not answer.done:
            return None
        self._finished = True
        return answer.take()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn, answer = self._conn, self._answer
        if self._finished and not answer.extra and answer.keep_alive:
            self._transport._give(self._origin, conn)
        else:
            conn.close()
