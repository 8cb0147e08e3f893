"""Limits at the HTTP edge of the sidecar's two APIs: connections, header and body sizes, and read
timeouts, so neither hostile nor broken clients can pin memory, descriptors or the event loop.

uvicorn offers part of this and we use it: ``h11_max_incomplete_event_size`` bounds the bytes
buffered for a request head still arriving (400 past it) and ``timeout_keep_alive`` closes idle
connections between requests. What it lacks we add:

- Nothing bounds how long an answer waits for a client that stopped reading it: both limited
  protocols drop a connection whose writes stay paused for ``body_timeout_s``.

- ``limit_concurrency`` only answers 503 to *requests* over the limit; a connection that never
  sends a request is accepted and kept forever (its keep-alive timer starts after a response).
  :func:`limited_protocol` makes uvicorn's h11 protocol close connections beyond a per-listener
  cap at once, and close a connection whose request head is not complete within a timeout
  (idle openers and slow-header senders alike).
- h11 does not bound a head that arrives whole in one read: :class:`BodyLimit` answers 431
  when the headers add up to more than the limit.
- Nothing bounds a body. :class:`BodyLimit` (ASGI middleware) answers 413 when Content-Length
  announces more than the limit (before reading a byte), counts while reading (chunked bodies
  are cut at the limit, 413) and answers 408 when the body does not arrive in time. Both close
  the connection.
- Nothing bounds the bodies of all connections together. :class:`BodyLimit` takes each body's
  bytes from the listener's :class:`~kvxferd.api.bodybudget.BodyBudget` (shared with the API's
  frames listener) before reading them: the announced length up front, a chunked body chunk by
  chunk. A body that finds no room waits unread (uvicorn stops reading the socket) within the
  body timeout, then 503 ``Busy``; the bytes are given back once the app has answered.

Two parsers carry the same limits: uvicorn's httptools protocol (the default where httptools
imports: the server's part of a request costs about half, 135-170 against 230-300 us on these
machines) and its h11 protocol (``http="h11"``, or where httptools is missing). httptools
bounds nothing while a head arrives, so :class:`LimitedHttpToolsProtocol` counts those bytes
itself.

Each listener is its own uvicorn server with its own cap, so a flood of the peer port never
takes the engine socket's capacity. The OpenAI front doors (``kvxferd sim``, ``kvxferd proxy``)
use the same pieces with their own limits and an OpenAI-shaped ``error_body``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # an install without httptools: h11 only
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from kvxferd.aio import http_parser
from kvxferd.api.bodybudget import DEFAULT_BODIES, BodyBudget
from kvxferd.wire import ErrorBody

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ErrorBodyFn = Callable[[int, str, str], bytes]
"""``(status, error, detail)`` to the JSON body of a refusal (``error`` names it, e.g.
``PayloadTooLarge``)."""


def kvxferd_error_body(status: int, error: str, detail: str) -> bytes:
    """The sidecar APIs' refusal body: an ErrorBody."""
    return msgspec.json.encode(ErrorBody(error=error, detail=detail))


@dataclass(frozen=True)
class EdgeLimits:
    """The limits of one listener (from kvxferd.config.Config)."""

    max_connections: int
    """Open connections beyond this are closed as soon as they are accepted."""
    max_header_bytes: int
    """Largest request head (request line and headers); larger ones answer 400 and close."""
    max_body_bytes: int
    """Largest request body; larger ones answer 413 and close."""
    header_timeout_s: float
    """A connection's request head must be complete this long after its first byte (or after
    the connection opened); else the connection is closed."""
    body_timeout_s: float
    """A request body must be complete this long after its head; else 408 and close. Also how
    long our writes may stall on a client that does not read its answer; then we drop it."""
    backlog: int = 64
    """The listen queue, and the most connections accepted in one go: it bounds how far past
    ``max_connections`` the descriptors of a flood can reach before they are closed."""
    http: str = "auto"
    """HTTP parser: ``httptools``, ``h11``, or ``auto`` (httptools when installed)."""
    max_body_bytes_in_flight: int = 0
    """Bytes of request bodies the listener holds at once across its connections; a body past
    it waits unread for room (within ``body_timeout_s``, else 503). 0: four times
    ``max_body_bytes`` (the front doors)."""

    @property
    def body_bytes_in_flight(self) -> int:
        """The listener's body budget in bytes (``max_body_bytes_in_flight`` or its default)."""
        return self.max_body_bytes_in_flight or DEFAULT_BODIES * self.max_body_bytes


class _HeadTimer:
    """The request-head timeout both limited protocols share: armed while a head is awaited,
    it closes the connection if the head is still not whole when it fires."""

    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            log.debug("closing a connection whose request head did not come in time")
            self.transport.close()


class _WriteTimer:
    """The write-stall timeout both limited protocols share: armed when the transport pauses
    our writes (the client stopped taking its answer), cancelled when it resumes them; if it
    fires, the connection is dropped (uvicorn would wait for the client forever)."""

    write_timeout_s = 30.0
    _write_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()  # type: ignore[misc]

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            log.debug("dropping a connection whose client stopped reading its answer")
        self.transport.abort()


class LimitedH11Protocol(_WriteTimer, _HeadTimer, H11Protocol):
    """uvicorn's h11 protocol with a per-listener connection cap and a request-head timeout.

    Configured through class attributes by :func:`limited_protocol` (uvicorn builds the protocol
    with a fixed signature)."""

    max_connections = 1024

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self.transport = transport  # type: ignore[assignment]  # for connection_lost
            transport.abort()  # nothing to flush: give the descriptor back on the next turn
            return
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._cancel_head_timer()
        elif self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # bytes of a head came, but not all of it yet
        else:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


if HttpToolsProtocol is not None:

    class LimitedHttpToolsProtocol(_WriteTimer, _HeadTimer, HttpToolsProtocol):
        """uvicorn's httptools protocol with the connection cap and head timeout of
        :class:`LimitedH11Protocol`, and a bound on a head still arriving: past
        ``max_header_bytes`` buffered for one head, 400 and close (httptools would keep them)."""

        max_connections = 1024
        max_header_bytes = 65536

        _in_head = True  # from the connection (or a message's first byte) to its whole head
        _head_bytes = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            if len(self.connections) >= self.max_connections:
                self.transport = transport  # type: ignore[assignment]  # for connection_lost
                self.parser = None  # type: ignore[assignment]
                transport.abort()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self.parser is None:
                return  # refused at accept, or already lost
            was_idle = not self._in_head and self.cycle is not None and self.cycle.response_complete
            if was_idle:  # a kept connection's next request begins with these bytes
                self._in_head, self._head_bytes = True, 0
            counting = self._in_head
            super().data_received(data)
            if self.transport.is_closing():
                self._cancel_head_timer()
            elif self._in_head and counting:
                self._head_bytes += len(data)
                if self._head_bytes > self.max_header_bytes:
                    self._cancel_head_timer()
                    self.send_400_response(
                        f"request head larger than the limit of {self.max_header_bytes} bytes"
                    )
                else:
                    self._arm_head_timer()  # bytes of a head came, but not all of it yet

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            self._cancel_head_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_write_timer()
            if self.flow is None:  # refused at accept: uvicorn never set it up
                return
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self._in_head


def limited_protocol(limits: EdgeLimits, name: str) -> type[asyncio.Protocol]:
    """A protocol class for one listener (its parser, connection cap, head timeout and size)."""
    attrs = {
        "max_connections": limits.max_connections,
        "header_timeout_s": limits.header_timeout_s,
        "max_header_bytes": limits.max_header_bytes,
        "write_timeout_s": limits.body_timeout_s,
    }
    if http_parser(limits.http) == "httptools":
        return type(f"LimitedHttpToolsProtocol_{name}", (LimitedHttpToolsProtocol,), attrs)
    return type(f"LimitedH11Protocol_{name}", (LimitedH11Protocol,), attrs)


def uvicorn_limits(limits: EdgeLimits, name: str) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.Config`` that apply ``limits`` to one listener."""
    return {
        "http": limited_protocol(limits, name),
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "backlog": limits.backlog,
    }


class BodyLimit:
    """ASGI middleware: check the head's size (431), read the whole body up front, bounded in
    size and time and within the listener's body budget, then hand it to ``app``. 413 (announced
    or counted past ``max_body_bytes``), 408 (not complete within ``body_timeout_s``) and 503
    (no room in ``budget`` within that time) close the connection; the app never sees such a
    request. The body's bytes go back to the budget once the app has answered."""

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float, max_header_bytes: int,
        error_body: ErrorBodyFn = kvxferd_error_body, budget: BodyBudget | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_header_bytes = max_header_bytes
        self.error_body = error_body
        self.budget = budget or BodyBudget(DEFAULT_BODIES * max_body_bytes)
        if self.budget.total < max_body_bytes:
            raise ValueError(f"a body budget of {self.budget.total} bytes cannot hold one "
                             f"{max_body_bytes}-byte body")  # fmt: skip

    @classmethod
    def of(cls, app: ASGIApp, limits: EdgeLimits, error_body: ErrorBodyFn = kvxferd_error_body,
           budget: BodyBudget | None = None) -> BodyLimit:  # fmt: skip
        """``app`` behind the size and time limits of one listener, and ``budget`` (else a
        budget of its own, ``limits.body_bytes_in_flight``)."""
        budget = budget or BodyBudget(limits.body_bytes_in_flight)
        return cls(app, limits.max_body_bytes, limits.body_timeout_s, limits.max_header_bytes,
                   error_body, budget)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if head > self.max_header_bytes:
            detail = f"request headers of {head} bytes exceed the limit of {self.max_header_bytes}"
            await self._reject(send, 431, "HeadersTooLarge", detail)
            return
        announced = _content_length(scope)
        if announced is not None and announced > self.max_body_bytes:
            await self._reject(send, 413, "PayloadTooLarge", self._too_large(f"{announced}"))
            return
        taken = _Taken(self.budget)
        try:
            body = await self._read_body(taken, announced, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
        finally:
            self.budget.give(taken.bytes)

    async def _read_body(
        self, taken: _Taken, announced: int | None, receive: Receive, send: Send
    ) -> bytes | None:
        """The whole body, its bytes taken from the budget first (the announced length before
        any is read, else each chunk as it comes); None once refused or when the client left."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                if announced:
                    await taken.take(announced)
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None  # the client is gone: nobody to answer
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        detail = self._too_large(f"> {size}")
                        await self._reject(send, 413, "PayloadTooLarge", detail)
                        return None
                    if announced is None:
                        await taken.take(len(chunk))
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            if taken.waiting:
                detail = (f"no room for the request body within {self.body_timeout_s:g} s: this "
                          f"listener holds at most {self.budget.total} bytes of request bodies "
                          "at once")  # fmt: skip
                await self._reject(send, 503, "Busy", detail)
            else:
                detail = f"the request body did not arrive within {self.body_timeout_s:g} s"
                await self._reject(send, 408, "RequestTimeout", detail)
            return None

    async def _reject(self, send: Send, status: int, error: str, detail: str) -> None:
        await _reject(send, status, self.error_body(status, error, detail))

    def _too_large(self, size: str) -> str:
        return f"request body of {size} bytes is larger than the limit of {self.max_body_bytes}"


class _Taken:
    """The bytes one request took from its budget so far, and whether it is waiting for more
    (a timeout then is the budget's 503, not the client's 408)."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0
        self.waiting = False

    async def take(self, n: int) -> None:
        self.waiting = True
        await self.budget.take(n)
        self.bytes += n
        self.waiting = False


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's ``receive``: the whole body once, then the connection's own messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as usual

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 rejects a malformed Content-Length before we see it
    return None


async def _reject(send: Send, status: int, body: bytes) -> None:
    """A refusal that closes the connection (its unread body is never read)."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
