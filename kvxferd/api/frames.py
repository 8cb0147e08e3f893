"""The framed protocol: length-prefixed MessagePack frames on a Unix socket (engine API) or on
TCP (the peer API's claims, heartbeats and declines).

HTTP costs more than a millisecond a call on the engine socket (h11, uvicorn, starlette, httpx)
while decoding a body costs microseconds. This listener serves the same route table (OPERATIONS)
through the same :func:`~kvxferd.api.operations.invoke` as HTTP: same gates, same statuses, same
ErrorBody with the offending field. Frame and envelope: :mod:`kvxferd.wire.frames`. A signed
operation is served only with ``Gate.verify``: its request's ``auth`` is checked (the signature
over method, path and the body's exact bytes, as over HTTP) before the body is decoded, and a
missing or wrong one answers 401 like HTTP's.

Limits, like the HTTP edge's: a connection cap (more are closed at once), a frame-size cap, a
bound on requests in flight per connection (past it the connection is not read until one
answers), an idle timeout, and a timeout for the rest of a frame once its header came and for
the client to take an answer. A malformed or oversized frame closes its connection only. Across
connections, a frame's payload is taken from the API's
:class:`~kvxferd.api.bodybudget.BodyBudget` (shared with its HTTP listener) before it is read and
given back once its call has answered; a frame that finds no room within the frame timeout
closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import msgspec

from kvxferd.aio import Cork
from kvxferd.api.bodybudget import DEFAULT_BODIES, BodyBudget
from kvxferd.api.codec import HTTPProblem, Negotiated, auth_problem
from kvxferd.api.operations import Gate, Operation, failed, invoke
from kvxferd.errors import AuthError
from kvxferd.wire import ErrorBody, FrameAnswer, FrameRequest
from kvxferd.wire.frames import FRAME_HEADER, NIL, frame, frame_length

log = logging.getLogger(__name__)

MSGPACK_BOTH = Negotiated(body_msgpack=True, answer_msgpack=True)
_PARAM = re.compile(r"{(\w+)}")
_request_decoder = msgspec.msgpack.Decoder(FrameRequest)
_encoder = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class FrameLimits:
    """The limits of the frames listener."""

    max_connections: int
    """Open connections beyond this are closed as soon as they are accepted."""
    max_frame_bytes: int
    """Largest frame payload; a larger header closes the connection before a byte is read."""
    max_in_flight: int = 64
    """Requests of one connection being served at once; more wait unread in the socket."""
    idle_timeout_s: float = 30.0
    """A connection with nothing in flight and no new frame for this long is closed."""
    frame_timeout_s: float = 30.0
    """The rest of a frame must arrive this long after its header, and the client must take an
    answer this long after it was written; else the connection closes."""
    backlog: int = 64
    """The listen queue (counted in the open-file budget like the HTTP listeners')."""
    max_bytes_in_flight: int = 0
    """Bytes of frame payloads the listener holds at once across its connections (read, and
    not yet answered); 0: four times ``max_frame_bytes``."""

    @property
    def bytes_in_flight(self) -> int:
        """The listener's payload budget in bytes (``max_bytes_in_flight`` or its default)."""
        return self.max_bytes_in_flight or DEFAULT_BODIES * self.max_frame_bytes


class Router:
    """``"METHOD /path"`` to the operation and its path parameters, in route-table order."""

    def __init__(self, operations: list[Operation]) -> None:
        self._routes: list[tuple[re.Pattern[str], Operation]] = []
        for op in operations:
            if op.handler is None:
                continue
            parts = _PARAM.split(op.path)  # literal, name, literal, name, ..., literal
            pattern = "".join(
                re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)"
                for i, part in enumerate(parts)
            )
            self._routes.append((re.compile(f"{pattern}$"), op))
        self._exact = {f"{op.method} {op.path}": op for _, op in self._routes if "{" not in op.path}

    def match(self, name: str) -> tuple[Operation, dict[str, str]]:
        """The operation ``name`` calls, or a 404/405 HTTPProblem worded as HTTP's."""
        op = self._exact.get(name)
        if op is not None:
            return op, {}
        method, _, path = name.partition(" ")
        path = unquote(path.split("?", 1)[0])
        allowed = False
        for pattern, op in self._routes:
            found = pattern.match(path)
            if found is None:
                continue
            if op.method == method:
                return op, found.groupdict()
            allowed = True
        if allowed:
            raise HTTPProblem(405, ErrorBody(error="MethodNotAllowed", detail="Method Not Allowed"))
        raise HTTPProblem(404, ErrorBody(error="NotFound", detail="Not Found"))


class FrameServer:
    """Serve ``operations`` of ``target`` as frames on a bound Unix socket, holding payloads
    within ``budget`` (shared with the API's HTTP listener; else one of its own)."""

    def __init__(
        self, operations: list[Operation], target: object, gate: Gate, limits: FrameLimits,
        budget: BodyBudget | None = None,
    ) -> None:  # fmt: skip
        if gate.verify is None and any(op.auth for op in operations if op.handler is not None):
            raise ValueError("operations need a signature but the gate has no verify check")
        self.budget = budget or BodyBudget(limits.bytes_in_flight)
        if self.budget.total < limits.max_frame_bytes:
            raise ValueError(f"a payload budget of {self.budget.total} bytes cannot hold one "
                             f"{limits.max_frame_bytes}-byte frame")  # fmt: skip
        self.router = Router(operations)
        self.target = target
        self.gate = gate
        self.limits = limits
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, sock: socket.socket) -> None:
        """Start accepting on ``sock`` (bound and listening; Unix or TCP)."""
        start = asyncio.start_unix_server if sock.family == socket.AF_UNIX else asyncio.start_server
        self._server = await start(
            self._accept, sock=sock, limit=1 << 16, backlog=self.limits.backlog
        )

    async def close(self, grace_s: float = 10.0) -> None:
        """Stop accepting and reading; give the calls running ``grace_s`` to answer, then
        cancel them and drop every connection."""
        if self._server is not None:
            self._server.close()
        for task in self._conns:
            task.cancel()  # stops the read loop; the connection then waits for its calls
        if self._conns:
            await asyncio.wait(self._conns, timeout=grace_s)
        for task in list(self._conns):
            task.cancel()  # past the grace: the calls too
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.limits.max_connections:
            writer.transport.abort()
            return
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await _Connection(self, reader, writer).serve()
        except asyncio.CancelledError:
            pass  # close(): this task is the connection's own; end it quietly
        finally:
            writer.transport.abort()
            try:  # the socket closes a loop turn later: it stops counting once it has
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            finally:
                self.connections -= 1
                self._conns.discard(task)


class _Connection:
    """One client connection: reads frames, runs each call as a task, writes the answers."""

    def __init__(
        self, server: FrameServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.cork = Cork(writer)
        self.slots = asyncio.Semaphore(server.limits.max_in_flight)
        self.calls: set[asyncio.Task[None]] = set()

    async def serve(self) -> None:
        limits = self.server.limits
        try:
            while True:
                await self.slots.acquire()
                payload = await self._read_frame(limits)
                if payload is None:
                    return
                try:
                    req = _request_decoder.decode(payload)
                except (msgspec.MsgspecError, RecursionError) as exc:
                    self.server.budget.give(len(payload))
                    log.debug("frames: closing a connection that sent a bad envelope: %s", exc)
                    return
                task = asyncio.create_task(self._call(req))
                self.calls.add(task)
                # A callback, not the call's finally: a task cancelled before it ran has none.
                task.add_done_callback(functools.partial(self._done, len(payload)))
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            # Calls already running finish (a pull is never cut in half) and answer while the
            # client is still there. The connection counts against the cap until then.
            if self.calls:
                await asyncio.gather(*self.calls, return_exceptions=True)

    async def _read_frame(self, limits: FrameLimits) -> bytes | None:
        """The next frame's payload, its bytes taken from the budget; None at a clean end, when
        idle too long, after an oversized header or when the budget had no room in time."""
        while True:
            try:
                async with asyncio.timeout(limits.idle_timeout_s):
                    header = await self.reader.read(FRAME_HEADER)  # cancel-safe: nothing lost
                break
            except TimeoutError:
                if not self.calls:
                    return None  # idle: nothing sent, nothing running
        if not header:
            return None
        deadline = asyncio.get_running_loop().time() + limits.frame_timeout_s
        async with asyncio.timeout_at(deadline):
            if len(header) < FRAME_HEADER:
                header += await self.reader.readexactly(FRAME_HEADER - len(header))
        size = frame_length(header)
        if size > limits.max_frame_bytes:
            log.debug("frames: closing a connection that announced a %d-byte frame", size)
            return None
        if not await self._take(size, deadline):
            return None
        try:
            async with asyncio.timeout_at(deadline):
                return await self.reader.readexactly(size)
        except BaseException:
            self.server.budget.give(size)
            raise

    async def _take(self, size: int, deadline: float) -> bool:
        """Take ``size`` bytes from the budget before they are read (they wait in the socket
        meanwhile); False when no room came by ``deadline``."""
        budget = self.server.budget
        try:
            async with asyncio.timeout_at(deadline):
                await budget.take(size)
        except TimeoutError:
            log.debug("frames: closing a connection whose %d-byte frame found no room in the "
                      "%d-byte budget in time", size, budget.total)  # fmt: skip
            return False
        return True

    def _done(self, size: int, task: asyncio.Task[None]) -> None:
        self.calls.discard(task)
        self.slots.release()
        self.server.budget.give(size)

    async def _call(self, req: FrameRequest) -> None:
        server = self.server
        status, body = await answer(server.router, server.target, server.gate, req)
        if self.writer.is_closing():
            return
        self.cork.write(frame(_encoder.encode(FrameAnswer(id=req.id, status=status, body=body))))
        try:
            async with asyncio.timeout(server.limits.frame_timeout_s):
                await self.cork.drain()
        except TimeoutError:  # a client that does not read its answers would pin us forever
            log.debug("frames: closing a connection that does not read its answers")
            self.writer.transport.abort()
        except ConnectionError:
            pass


async def answer(
    router: Router, target: object, gate: Gate, req: FrameRequest
) -> tuple[int, msgspec.Raw]:
    """The status and MessagePack body answering ``req`` (what HTTP would answer)."""
    op: Operation | None = None
    try:
        op, params = router.match(req.op)
        if op.auth:
            _verify(gate, req)
        result: Any = await invoke(
            op, target, gate, memoryview(req.body), MSGPACK_BOTH, params, req.query
        )
        if result is None:
            return op.status, NIL
        return op.status, msgspec.Raw(_encoder.encode(result))
    except Exception as exc:
        problem = failed(op, exc) if op is not None else _unrouted(exc)
        return problem.status, msgspec.Raw(_encoder.encode(problem.body))


def _verify(gate: Gate, req: FrameRequest) -> None:
    """Admit a request of a signed operation: its signature covers the method, the op's path
    and the body's exact bytes; queries are not signed, so a signed request has none."""
    assert gate.verify is not None  # checked by FrameServer
    if req.query:
        detail = "a signed operation takes no query parameters"
        raise HTTPProblem(400, ErrorBody(error="BadRequest", detail=detail, field="query"))
    method, _, target = req.op.partition(" ")
    try:
        gate.verify(method, target, bytes(req.body), req.auth)
    except AuthError as exc:
        raise HTTPProblem(401, auth_problem(exc)) from None


def _unrouted(exc: Exception) -> HTTPProblem:
    assert isinstance(exc, HTTPProblem)  # Router.match raises only these
    return exc
