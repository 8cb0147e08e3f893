"""Client connections of the framed protocol (kvxferd.wire.frames).

``FrameConn`` (blocking: a call per connection, a few idle connections kept for the next calls,
thread-safe; the engine socket) and ``AsyncFrameConn`` (asyncio: many calls in flight on one
connection, answers matched by id; the engine socket, or a peer's framed TCP port) send a
FrameRequest and return the answer's status and body. Every call is bounded by its timeout; a
connection that failed, timed out or sat idle longer than the server keeps it is replaced on the
next call; ``close`` releases everything. Failures raise :class:`FrameLinkError` (no answer
came), :class:`FrameConnectError` when no connection could be opened (so nothing was sent),
:class:`FrameConnectTimeoutError` when opening it took too long (a TCP listener whose accept
queue is full), :class:`FrameRefusedError` when the server closed a new connection before a
byte of answer (a listener at its connection cap closes new ones unread: nothing sent on it was
taken). Calls that waited for a connect that failed fail with it (another of the same kind):
each does not wait for a connect of its own in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import select
import socket
import threading
import time
from typing import Any

import msgspec

from kvxferd.aio import Cork
from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S
from kvxferd.wire.frames import FRAME_HEADER, FrameAnswer, FrameRequest, frame, frame_length

IDLE_S = HTTP_CLIENT_KEEPALIVE_S
"""A connection idle this long is replaced before the next call (the server closes idle ones
after HTTP_SERVER_KEEPALIVE_S): a call never races the server's close."""
MAX_ANSWER_BYTES = 1 << 30
"""Largest answer frame accepted (feeds are paged at about 1 MiB)."""
_encoder = msgspec.msgpack.Encoder()
_answer_decoder = msgspec.msgpack.Decoder(FrameAnswer)


class FrameLinkError(ConnectionError):
    """No usable answer: the socket is missing, the connection failed, closed or timed out."""


class FrameConnectError(FrameLinkError):
    """No connection could be opened: the request was not sent."""


class FrameConnectTimeoutError(FrameConnectError):
    """Opening the connection took longer than its bound: nothing was sent. A listener whose
    accept queue is full (a flood) drops new connections' SYNs; so does a firewall dropping
    them."""


class FrameRefusedError(FrameConnectError):
    """The server closed the connection before it sent a byte on it: a listener at its
    connection cap closes what it accepts at once, unread, so no call sent on it was taken (a
    server that died after taking one looks the same; a call tried again elsewhere then finds
    it gone, or restarted under another epoch)."""


def _request(
    call_id: int, op: str, query: dict[str, Any] | None, body: msgspec.Raw, auth: str = ""
) -> bytes:
    req = FrameRequest(id=call_id, op=op, query=query or {}, body=body, auth=auth)
    return frame(_encoder.encode(req))


def _answer(payload: bytes) -> FrameAnswer:
    try:
        return _answer_decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise FrameLinkError(f"unreadable answer frame: {exc}") from None


class FrameConn:
    """Blocking framed connections to one sidecar, thread-safe: a call takes an idle connection
    (or opens one), so calls from several threads run side by side as over HTTP's pool, and
    at most ``max_idle`` connections are kept between calls."""

    def __init__(self, path: str, timeout_s: float, max_idle: int = 4) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, last used), LIFO
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def call(self, op: str, query: dict[str, Any] | None, body: msgspec.Raw,
             timeout_s: float | None = None) -> tuple[int, msgspec.Raw]:  # fmt: skip
        """Send one request and wait (at most ``timeout_s``) for its answer."""
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        call_id = next(self._ids)  # itertools.count is atomic under the GIL
        sock: socket.socket | None = None
        try:
            sock = self._take(deadline)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.sendall(_request(call_id, op, query, body))
            size = frame_length(_recv(sock, FRAME_HEADER, deadline))
            if size > MAX_ANSWER_BYTES:
                raise FrameLinkError(f"answer frame of {size} bytes")
            answer = _answer(_recv(sock, size, deadline))
            if answer.id != call_id:
                raise FrameLinkError(f"answer to call {answer.id}, expected {call_id}")
        except OSError as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, FrameLinkError):
                raise
            if isinstance(exc, TimeoutError):
                raise FrameLinkError(f"no answer in time ({wait_s:g} s)") from None
            raise FrameLinkError(repr(exc)) from exc
        except BaseException:
            if sock is not None:
                sock.close()  # interrupted mid-call: what is left on the socket is unusable
            raise
        self._give_back(sock)
        return answer.status, answer.body

    def close(self) -> None:
        """Close the idle connections; those of calls still running close when they end."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def _take(self, deadline: float) -> socket.socket:
        """A connection the server still holds open and has not idled out, or a new one."""
        now = time.monotonic()
        while True:
            with self._lock:
                if self._closed:
                    raise FrameLinkError("the client was closed")
                if not self._idle:
                    break
                sock, used_at = self._idle.pop()
            if now - used_at < IDLE_S and _open(sock):
                return sock
            sock.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline - now))
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes of ``sock`` by ``deadline`` (TimeoutError, or FrameLinkError at EOF)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise FrameLinkError("the sidecar closed the connection")
        buf += chunk
    return bytes(buf)


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` open (no EOF or error waiting on it): a dropped
    connection is replaced before a call is lost on it."""
    sock.settimeout(0)  # a socket with a timeout would wait for data before peeking
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


class _Link:
    """One open asyncio connection: its writer, the calls awaiting answers, its reader task."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.cork = Cork(writer)
        self.pending: dict[int, asyncio.Future[FrameAnswer]] = {}
        self.used_at = time.monotonic()
        self.closed = False
        self.heard = False
        """Whether the server sent anything on this connection (else its close refused it)."""
        self.task = asyncio.create_task(self._read(reader))
        # The loop may not have read the server's close yet when the next call comes: an idle
        # link is polled (no data is consumed) before it is reused.
        self._poll = select.poll()
        self._poll.register(writer.get_extra_info("socket").fileno(), select.POLLIN)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error: Exception = FrameLinkError("the sidecar closed the connection")
        try:
            while True:
                size = frame_length(await reader.readexactly(FRAME_HEADER))
                self.heard = True
                if size > MAX_ANSWER_BYTES:
                    error = FrameLinkError(f"answer frame of {size} bytes")
                    return
                answer = _answer(await reader.readexactly(size))
                fut = self.pending.pop(answer.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
                # An answer nobody waits for is a call that timed out: dropped.
        except (OSError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, FrameLinkError):
                error = exc
            elif not self.heard and not self.closed:  # closed by the server, not by us
                error = FrameRefusedError("the sidecar closed the connection before answering "
                                          "anything on it (at its connection cap)")  # fmt: skip
        finally:
            self.shut(error)

    def shut(self, error: Exception) -> None:
        """Close the connection and fail every call still waiting on it."""
        self.closed = True
        self.writer.transport.abort()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(error)
        self.pending.clear()

    def usable(self) -> bool:
        """Open, and busy, or recently used with nothing waiting to be read (an idle link that
        is readable holds the server's close, or a stray answer: replaced either way)."""
        if self.closed:
            return False
        if self.pending:
            return True
        return time.monotonic() - self.used_at < IDLE_S and not self._poll.poll(0)


class AsyncFrameConn:
    """An asyncio framed connection to one sidecar: calls share one connection, each waiting
    for its own answer. ``path`` is a Unix socket, or ``tcp=(host, port)`` a TCP listener (a
    peer's framed port; opening it is bounded by ``connect_timeout_s``)."""

    def __init__(
        self,
        path: str,
        timeout_s: float,
        *,
        tcp: tuple[str, int] | None = None,
        connect_timeout_s: float = 1.0,
    ) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.tcp = tcp
        self.connect_timeout_s = connect_timeout_s
        self._link: _Link | None = None
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock | None = None
        self._failed: tuple[int, FrameConnectError] = (0, FrameConnectError(""))
        """(connects that failed so far, the latest's error)."""

    async def call(
        self,
        op: str,
        query: dict[str, Any] | None,
        body: msgspec.Raw,
        timeout_s: float | None = None,
        auth: str = "",
    ) -> tuple[int, msgspec.Raw]:
        """Send one request (``auth``: its signature, for a signed operation) and wait (at most
        ``timeout_s``) for its answer."""
        call_id = next(self._ids)
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(wait_s):
                link = await self._connected()
                fut: asyncio.Future[FrameAnswer] = asyncio.get_running_loop().create_future()
                link.pending[call_id] = fut
                try:
                    link.cork.write(_request(call_id, op, query, body, auth))
                    # Lost: its reader tells why (refused or not) and fails ``fut`` with it.
                    with contextlib.suppress(ConnectionError):
                        await link.cork.drain()
                    answer = await fut
                finally:
                    link.pending.pop(call_id, None)
                    link.used_at = time.monotonic()
        except TimeoutError:
            raise FrameLinkError(f"no answer in time ({wait_s:g} s)") from None
        except OSError as exc:
            if isinstance(exc, FrameLinkError):
                raise
            raise FrameLinkError(repr(exc)) from exc
        return answer.status, answer.body

    async def aclose(self) -> None:
        """Close the connection, failing the calls still waiting on it."""
        link, self._link = self._link, None
        if link is not None:
            link.shut(FrameLinkError("the client was closed"))
            link.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await link.task

    async def _connected(self) -> _Link:
        link = self._link
        if link is not None and link.usable():
            return link
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        failures = self._failed[0]
        async with self._connecting:
            link = self._link
            if link is not None and link.usable():
                return link
            count, error = self._failed
            if count != failures:  # the connect this call waited for failed: so does the call
                raise type(error)(str(error))
            if link is not None:
                link.shut(FrameLinkError("replaced an idle connection"))
            try:
                if self.tcp is None:
                    reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 16)
                else:
                    async with asyncio.timeout(self.connect_timeout_s):
                        reader, writer = await asyncio.open_connection(*self.tcp, limit=1 << 16)
            except (OSError, TimeoutError) as exc:
                kind = FrameConnectTimeoutError if isinstance(exc, TimeoutError) else (
                    FrameConnectError)  # fmt: skip
                error = kind(f"cannot connect to {self.path}: {exc!r}")
                self._failed = (count + 1, error)
                raise error from exc
            self._link = _Link(reader, writer)
            return self._link
