"""A small HTTP/1.1 client for the peer API: keep-alive connections to one peer, no pool scan.

httpx costs about a millisecond of CPU per call, most of it in its connection pool's per-request
scans and anyio layers; a decode rank reading from 8 prefill ranks makes 8 claims per pull, and
those were most of the decode sidecar's CPU (scripts/bench_pulls.py, issue 11). This client
keeps its own connections on asyncio streams and frames the messages itself: a request is one
write of our own (validated) head and body; an answer is a status line and headers read in one
``readuntil`` and a body by Content-Length, chunked or until close (RFC 9112). h11 did the same
in ~47 us per call, 0.4 ms of decode CPU per pull at prefill TP 8; this takes a few us. Anything
else (no HTTP/1.x status line, a folded or malformed header, conflicting lengths, an unknown
transfer coding, a truncated body) is a PeerHTTPError and its connection is dropped. Bounded:
``limit`` connections at once, heads of MAX_HEAD bytes, bodies of MAX_BODY, every call by
``timeout_s``.

HTTP/1.1 answers carry no id, so a connection is kept only after a call read its whole answer:
one that ended otherwise (an error, its timeout, a cancellation) is dropped with whatever the
peer still sends on it (a slow peer's late answer), and a kept one on which anything arrived
unasked (a stray or repeated answer) is dropped before it is reused, never read as the next
call's answer. Bytes a peer sends after the next request left cannot be told from its answer;
a claim's answer names its hold, a heartbeat's or decline's only the holds asked about, each
in one list, which the caller checks (kvxferd.sidecar.peers).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
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
    """A kept connection was closed by the peer before any answer: retried once on a new one
    (signed anew: the peer may have read the request, and recorded its nonce, before closing),
    unless the call is one the peer must not get twice."""


@dataclass(frozen=True)
class Reply:
    """A peer's answer: status and body."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        """The body as text (for error details)."""
        return self.content.decode(errors="replace")


_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: .*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE = re.compile(r"[\x00\r\n]")


@dataclass(eq=False)
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def __post_init__(self) -> None:
        self._poll = select.poll()
        self._poll.register(self.writer.get_extra_info("socket").fileno(), select.POLLIN)

    def usable(self, now: float, keepalive_s: float) -> bool:
        """Kept for less than ``keepalive_s``, open, and nothing came since its last answer.
        HTTP/1.1 answers carry no id: bytes no request asked for (a stray or repeated answer,
        read by the loop already or still in the socket) would be read as the next call's
        answer, maybe another hold's claim. Such a connection is dropped, as is one whose
        close (EOF) waits in the socket."""
        return (now - self.idle_since < keepalive_s and not self.reader.at_eof()
                and not self.writer.is_closing()
                and not self.reader._buffer  # noqa: SLF001 - bytes the loop read, unasked
                and not self._poll.poll(0))  # fmt: skip

    def close(self) -> None:
        self.writer.close()


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a ``host:port`` or ``[v6]:port`` peer address."""
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

    async def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        sign: Callable[[], Mapping[str, str]] | None = None,
        *,
        resend: bool = True,
    ) -> Reply:
        """POST ``body`` to ``path``; the peer's reply (OSError or TimeoutError otherwise).

        A kept connection the peer closed before answering is retried once on a new one, if
        ``resend``: the peer may have read the first attempt, and done it, before it closed, so
        only a call that does the same done twice may be sent again (a claim is not: a second
        one counts a second READ). ``sign`` gives headers made anew for each attempt (a
        signature with a fresh nonce): the peer may have recorded the first attempt's nonce,
        and the same signature again would be refused as a replay."""
        request = self._head(path, body, headers, sign)
        async with asyncio.timeout(self._timeout), self._slots:
            conn = self._take()
            if conn is not None:
                try:
                    return await self._exchange(conn, request, body)
                except _Stale:  # closed by the peer (idle, or read and dropped unanswered)
                    if not resend:
                        raise
                    if sign is not None:
                        request = self._head(path, body, headers, sign)
            return await self._exchange(await self._open(), request, body)

    def _head(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        sign: Callable[[], Mapping[str, str]] | None,
    ) -> bytes:
        """The request's head, with ``sign``'s headers made now."""
        fields = headers if sign is None else {**headers, **sign()}
        return _request(path, self.address, body, fields)

    def _take(self) -> _Conn | None:
        now = self._clock()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self._keepalive):
                return conn
            conn.close()
        return None

    async def _open(self) -> _Conn:
        host, port = split_address(self.address)
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD)
        self.opened += 1
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, request: bytes, body: bytes) -> Reply:
        keep = False
        try:
            try:
                conn.writer.write(request + body)  # one write: one segment for a claim
                await conn.writer.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Stale(f"{self.address}: connection closed before the request") from exc
            reply, keep = await _read_reply(conn)
            return reply
        except PeerHTTPError as exc:
            if isinstance(exc, _Stale):
                raise
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


def _request(path: str, host: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    """A POST request's head; PeerHTTPError for a field that would break the framing (an
    address from a ticket is input)."""
    fields = {"Host": host, "Content-Length": str(len(body)), **headers}
    for text in (path, *fields, *fields.values()):
        if _UNSAFE.search(text):
            raise PeerHTTPError(f"request field {text[:40]!r} holds CR, LF or NUL")
    if not path.startswith("/") or " " in path:
        raise PeerHTTPError(f"request target {path!r} is not an origin-form path")
    lines = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode("latin-1")


async def _read_head(conn: _Conn) -> bytes:
    """A response head (status line and headers, without the blank line)."""
    try:
        return (await conn.reader.readuntil(b"\r\n\r\n"))[:-4]
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise _Stale("peer closed the connection before answering") from None
        raise PeerHTTPError("connection closed mid-answer") from None
    except asyncio.LimitOverrunError:
        raise PeerHTTPError(f"answer head over {MAX_HEAD} B") from None
    except ConnectionResetError as exc:
        raise _Stale("peer reset the connection before answering") from exc


def _parse_head(head: bytes) -> tuple[int, bool, dict[bytes, list[bytes]]]:
    """(status, HTTP/1.1, headers by lower-case name) of a response head."""
    status_line, _, rest = head.partition(b"\r\n")
    match = _STATUS.fullmatch(status_line)
    if match is None:
        raise PeerHTTPError(f"not an HTTP/1.x status line: {status_line[:40]!r}")
    fields: dict[bytes, list[bytes]] = {}
    for line in rest.split(b"\r\n") if rest else ():
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:  # also a folded line (leading space)
            raise PeerHTTPError(f"malformed header line {line[:40]!r}")
        fields.setdefault(name.lower(), []).append(value.strip(b" \t"))
    return int(match[2]), match[1] == b"1", fields


def _length(fields: dict[bytes, list[bytes]]) -> int | None:
    """The Content-Length (None without one); conflicting or malformed ones are errors."""
    values = {v.strip() for raw in fields.get(b"content-length", ()) for v in raw.split(b",")}
    if not values:
        return None
    if len(values) > 1 or not all(v.isdigit() for v in values):
        raise PeerHTTPError(f"bad content-length {sorted(values)!r}")
    digits = values.pop().lstrip(b"0") or b"0"
    if len(digits) > len(str(MAX_BODY)):  # int() refuses more than 4,300 digits (ValueError)
        raise PeerHTTPError(f"answer body of a {len(digits)}-digit length over {MAX_BODY} B")
    length = int(digits)
    if length > MAX_BODY:
        raise PeerHTTPError(f"answer body of {length} B over {MAX_BODY} B")
    return length


async def _exactly(conn: _Conn, n: int) -> bytes:
    try:
        return await conn.reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise PeerHTTPError("connection closed mid-answer (body truncated)") from None


async def _chunked(conn: _Conn) -> bytes:
    """A chunked body (RFC 9112 7.1), trailers skipped; bounded by MAX_BODY."""
    chunks, size = [], 0
    try:
        while True:
            line = (await conn.reader.readuntil(b"\r\n"))[:-2]
            digits = line.partition(b";")[0].strip()
            if not digits or any(c not in b"0123456789abcdefABCDEF" for c in digits):
                raise PeerHTTPError(f"bad chunk size {line[:40]!r}")
            n = int(digits, 16)
            if n == 0:
                while await conn.reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailer fields
                return b"".join(chunks)
            size += n
            if size > MAX_BODY:
                raise PeerHTTPError(f"answer body over {MAX_BODY} B")
            chunks.append(await conn.reader.readexactly(n))
            if await conn.reader.readexactly(2) != b"\r\n":
                raise PeerHTTPError("chunk not followed by CRLF")
    except asyncio.IncompleteReadError:
        raise PeerHTTPError("connection closed mid-answer (chunked body)") from None
    except asyncio.LimitOverrunError:
        raise PeerHTTPError("chunk line too long") from None


async def _until_close(conn: _Conn) -> bytes:
    chunks, size = [], 0
    while data := await conn.reader.read(1 << 16):
        size += len(data)
        if size > MAX_BODY:
            raise PeerHTTPError(f"answer body over {MAX_BODY} B")
        chunks.append(data)
    return b"".join(chunks)


async def _read_reply(conn: _Conn) -> tuple[Reply, bool]:
    """One response and whether its connection may be kept (RFC 9112 6.3 framing)."""
    while True:
        status, http11, fields = _parse_head(await _read_head(conn))
        if status == 101:
            raise PeerHTTPError("unexpected protocol switch")
        if status >= 200:
            break  # 1xx: informational, the answer follows
    tokens = {t.strip().lower() for v in fields.get(b"connection", ()) for t in v.split(b",")}
    keep = http11 and b"close" not in tokens
    coding = fields.get(b"transfer-encoding")
    length = _length(fields)
    if coding is not None:
        if length is not None or [c.lower() for c in coding] != [b"chunked"]:
            raise PeerHTTPError(f"unsupported transfer-encoding {coding!r} (or with a length)")
        body = await _chunked(conn)
    elif status in (204, 304):
        body = b""
    elif length is not None:
        body = await _exactly(conn, length)
    else:
        body, keep = await _until_close(conn), False
    return Reply(status, body), keep
