"""Engine-side client of the sidecar's engine API (httpx over the Unix socket).

``EngineClient`` (sync) and ``AsyncEngineClient`` take and return wire Structs. Both are thin
drivers of one I/O-free core: each operation is a ``_Call`` (what to send, what the answer
decodes to), and multi-step operations (``wait_pull``) are generators of calls, so the two
classes cannot drift apart.

An error answer raises the kvxferd exception the sidecar raised (same class, same ``field``)
when it can be rebuilt, else ``SidecarError``. Every exception raised here carries ``status``
(the HTTP status, None when no answer came) and ``body`` (the sidecar's ErrorBody).

With ``msgpack=True`` (the default) the per-request calls (holds, pulls, feeds, keepalive,
decline, store) send and accept MessagePack; the once-per-process calls (register, unregister,
identity, healthz) and every client built with ``msgpack=False`` (tools) speak JSON. Answers
are decoded by their Content-Type either way.

With ``frames=True`` every call goes over the sidecar's framed protocol instead (its second Unix
socket, ``<engine socket>.frames``; kvxferd.frameconn): the same operations, statuses, bodies
and errors as MessagePack over HTTP without the HTTP stack (see scripts/bench_engine_wire.py).
"""

from __future__ import annotations

import inspect
import os
import socket
import stat
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvxferd import errors
from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S, frames_socket_of
from kvxferd.frameconn import AsyncFrameConn, FrameConn, FrameLinkError
from kvxferd.lanes import ASYNC_LANES, Lanes, ssl_context
from kvxferd.wire import (
    AbortHoldRequest,
    AnyRegionSpec,
    DeclineRequest,
    DeclineResponse,
    ErrorBody,
    FinishedPulls,
    HeartbeatResponse,
    HoldRequest,
    Identity,
    KeepaliveRequest,
    Manifest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    ReleasedHolds,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookup,
    StoreLookupRequest,
    StoreSaved,
    StoreSaveRequest,
    Ticket,
    UnregisterRequest,
)
from kvxferd.wire.frames import NIL
from kvxferd.wire.store import STORE_SAVE_DEADLINE_S

T = TypeVar("T")
_BASE = "http://kvxferd"
_LIMITS = httpx.Limits(keepalive_expiry=HTTP_CLIENT_KEEPALIVE_S)
POLL_SLICE_S = 30.0
"""Longest single long-poll of wait_pull (the sidecar cuts ``wait`` at 60 s anyway)."""
_POLL_MARGIN_S = 10.0  # HTTP timeout of a long poll beyond its wait
_RUN_MARGIN_S = 15.0  # HTTP timeout of a run pull beyond its deadline (READs settling)
_FINAL = ("done", "failed")
MSGPACK = "application/msgpack"
MSGPACK_DEFAULT = True
"""Whether clients use MessagePack for the per-request calls unless told otherwise
(scripts/bench_engine_wire.py measures it against JSON)."""
_JSON_BODY = {"Content-Type": "application/json"}
_MSGPACK_BODY = {"Content-Type": MSGPACK, "Accept": MSGPACK}
_MSGPACK_ANSWER = {"Accept": MSGPACK}
_msgpack_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


class SidecarError(errors.KvxferdError):
    """The sidecar answered an error no kvxferd class rebuilds (or an unusable answer)."""

    status = 502  # re-raised by a server (the sim): the sidecar behind it failed

    def __init__(self, status: int | None, body: ErrorBody) -> None:
        prefix = f"{status} " if status is not None else ""
        super().__init__(f"{prefix}{body.error}: {body.detail}")
        self.status = status
        self.body = body
        self.field = body.field


class SidecarUnreachableError(SidecarError):
    """No answer: the socket is missing, the connection failed or timed out."""

    def __init__(self, detail: str) -> None:
        super().__init__(None, ErrorBody(error="Unreachable", detail=detail))


# ------------------------------------------------------------------------------ the I/O-free core


@dataclass(frozen=True)
class _Call:
    """One HTTP exchange: the request to send and the Struct its answer decodes to."""

    method: str
    path: str
    answer: type | None = None
    body: Any = None
    params: dict[str, Any] | None = None
    timeout_s: float | None = None
    lean: bool = False
    """A per-request call: MessagePack when the client uses it."""

    def request_args(self, msgpack: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``httpx.Client.request`` after method and url; ``msgpack``: the
        client's choice (applied to lean calls only)."""
        args: dict[str, Any] = {}
        packed = msgpack and self.lean
        if self.body is not None:
            if packed:
                args["content"] = msgspec.msgpack.encode(self.body)
                args["headers"] = _MSGPACK_BODY
            else:
                args["content"] = msgspec.json.encode(self.body)
                args["headers"] = _JSON_BODY
        elif packed:
            args["headers"] = _MSGPACK_ANSWER
        if self.params is not None:
            args["params"] = self.params
        if self.timeout_s is not None:
            args["timeout"] = self.timeout_s
        return args

    def result(self, resp: httpx.Response) -> Any:
        """The decoded answer, or the error it carries raised."""
        if resp.status_code >= 400:
            raise error_for(resp.status_code, _error_body(resp))
        if self.answer is None:
            return None
        try:
            if _is_msgpack(resp):
                return _msgpack_decoder(self.answer).decode(resp.content)
            return msgspec.json.decode(resp.content, type=self.answer)
        except msgspec.MsgspecError as exc:
            body = ErrorBody(error="DecodeError", detail=f"unusable {self.answer.__name__}: {exc}")
            raise error_for(resp.status_code, body) from None

    def frame_args(self) -> tuple[str, dict[str, Any] | None, msgspec.Raw]:
        """The ``op``, ``query`` and ``body`` of this call's FrameRequest."""
        body = NIL if self.body is None else msgspec.Raw(msgspec.msgpack.encode(self.body))
        return f"{self.method} {self.path}", self.params, body

    def frame_result(self, status: int, body: msgspec.Raw) -> Any:
        """The decoded answer of a FrameAnswer, or the error it carries raised."""
        try:
            if status >= 400:
                raise error_for(status, _msgpack_decoder(ErrorBody).decode(body))
            if self.answer is None:
                return None
            return _msgpack_decoder(self.answer).decode(body)
        except msgspec.MsgspecError as exc:
            what = "ErrorBody" if status >= 400 else self.answer.__name__  # type: ignore[union-attr]
            detail = f"unusable {what}: {exc}"
            raise error_for(status, ErrorBody(error="DecodeError", detail=detail)) from None


def frames_available(socket_path: str) -> bool:
    """Whether the sidecar at ``socket_path`` serves frames at the default place (a socket
    file exists there)."""
    try:
        return stat.S_ISSOCK(os.stat(frames_socket_of(socket_path)).st_mode)
    except OSError:
        return False


def _is_msgpack(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith(MSGPACK)


def _msgpack_decoder(kind: type) -> msgspec.msgpack.Decoder[Any]:
    decoder = _msgpack_decoders.get(kind)
    if decoder is None:
        decoder = _msgpack_decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder


def _register(manifest: Manifest, regions: list[AnyRegionSpec], instance: str = "") -> _Call:
    req = RegisterRequest(manifest=manifest, regions=regions, instance=instance)
    return _Call("POST", "/v1/register", RegisterResponse, req)


def _hold(req: HoldRequest) -> _Call:
    return _Call("POST", "/v1/holds", Ticket, req, lean=True)


def _abort(hold_id: str) -> _Call:
    return _Call("POST", "/v1/holds/abort", None, AbortHoldRequest(hold_id=hold_id), lean=True)


def _pull(req: PullRequest) -> _Call:
    return _Call("POST", "/v1/pulls", PullAccepted, req, lean=True)


def _pull_status(pull_id: str, wait_s: float) -> _Call:
    wait_s = max(0.0, wait_s)
    path = f"/v1/pulls/{quote(pull_id, safe='')}"
    return _Call("GET", path, PullStatus, params={"wait": wait_s},
                 timeout_s=wait_s + _POLL_MARGIN_S, lean=True)  # fmt: skip


def _run_pull(req: PullRequest) -> _Call:  # answered by its deadline + its READs' settling
    return _Call("POST", "/v1/pulls/run", PullStatus, req,
                 timeout_s=req.deadline_s + _RUN_MARGIN_S, lean=True)  # fmt: skip


def _finished_pulls(cursor: int, limit: int) -> _Call:
    return _Call("GET", "/v1/pulls/finished", FinishedPulls,
                 params={"cursor": cursor, "limit": limit}, lean=True)  # fmt: skip


def _keepalive(tickets: list[Ticket], extend_s: float) -> _Call:
    req = KeepaliveRequest(tickets=tickets, extend_s=extend_s)
    return _Call("POST", "/v1/keepalive", HeartbeatResponse, req, lean=True)


def _decline(tickets: list[Ticket], reason: str) -> _Call:
    req = DeclineRequest(tickets=tickets, reason=reason)
    return _Call("POST", "/v1/decline", DeclineResponse, req, lean=True)


def _unregister(generation: int) -> _Call:
    return _Call("POST", "/v1/unregister", None, UnregisterRequest(generation=generation))


def _identity() -> _Call:
    return _Call("GET", "/v1/identity", Identity)


def _healthz() -> _Call:
    return _Call("GET", "/healthz")


def _released(cursor: int, limit: int | None = None) -> _Call:
    params = {"cursor": cursor} if limit is None else {"cursor": cursor, "limit": limit}
    return _Call("GET", "/v1/released", ReleasedHolds, params=params, lean=True)


def _store_save(req: StoreSaveRequest) -> _Call:  # answered by its deadline + the last writes
    return _Call("POST", "/v1/store/save", StoreSaved, req, lean=True,
                 timeout_s=STORE_SAVE_DEADLINE_S + _RUN_MARGIN_S)  # fmt: skip


def _store_lookup(req: StoreLookupRequest) -> _Call:
    return _Call("POST", "/v1/store/lookup", StoreLookup, req, lean=True)


def _store_load(req: StoreLoadRequest) -> _Call:  # answered by its deadline + a chunk's copy
    return _Call("POST", "/v1/store/load", StoreLoadStatus, req, lean=True,
                 timeout_s=req.deadline_s + _RUN_MARGIN_S)  # fmt: skip


def _wait_pull(
    pull_id: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
) -> Generator[_Call, PullStatus, PullStatus]:
    """Long-poll a pull in slices until it is done or failed, or ``timeout_s`` has passed."""
    end = clock() + timeout_s
    while True:
        left = end - clock()
        status = yield _pull_status(pull_id, min(left, POLL_SLICE_S))
        if status.state in _FINAL or end - clock() <= 0:
            return status


def _error_body(resp: httpx.Response) -> ErrorBody:
    try:
        if _is_msgpack(resp):
            return _msgpack_decoder(ErrorBody).decode(resp.content)
        return msgspec.json.decode(resp.content, type=ErrorBody)
    except msgspec.MsgspecError:
        return ErrorBody(error="HTTPError", detail=resp.text[:500])


def _kvxferd_errors() -> dict[str, type[errors.KvxferdError]]:
    out: dict[str, type[errors.KvxferdError]] = {}
    todo: list[type[errors.KvxferdError]] = [errors.KvxferdError]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return {name: cls for name, cls in out.items() if cls.__module__ == errors.__name__}


_BY_NAME = _kvxferd_errors()
_FORMER_NAMES: dict[str, type[errors.KvxferdError]] = {"NotReady": errors.NotRegisteredError}
"""Error names older sidecars answer, and the class that stands for them now."""


def error_for(status: int, body: ErrorBody) -> errors.KvxferdError:
    """The exception an error answer stands for: the sidecar's own class when the body rebuilds
    it (message-only classes and the ``(field, reason)`` ones; a former name such as NotReady
    maps to today's class), else SidecarError."""
    kind = _BY_NAME.get(body.error) or _FORMER_NAMES.get(body.error)
    exc = _rebuild(kind, body) if kind is not None else None
    if exc is None:
        exc = SidecarError(status, body)
    exc.status = status  # type: ignore[attr-defined]
    exc.body = body  # type: ignore[attr-defined]
    return exc


def _rebuild(kind: type[errors.KvxferdError], body: ErrorBody) -> errors.KvxferdError | None:
    if kind.__init__ is errors.KvxferdError.__init__:
        return kind(body.detail)
    if list(inspect.signature(kind.__init__).parameters)[1:] == ["field", "reason"]:
        return kind(body.field, body.detail.removeprefix(f"{body.field}: "))  # type: ignore[call-arg]
    return None


def _close_abandoned_sockets(exc: BaseException) -> None:
    """Close the socket a failed connect left in its frames: httpcore's sync Unix-socket connect
    does not close it on failure, leaving the descriptor to the garbage collector (which warns)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        tb = cur.__traceback__
        while tb is not None:
            for value in tb.tb_frame.f_locals.values():
                if isinstance(value, socket.socket):
                    value.close()
            tb = tb.tb_next
        cur = cur.__cause__ or cur.__context__


# ------------------------------------------------------------------------------ the two drivers


class EngineClient:
    """Blocking client; one per engine rank. ``msgpack``: MessagePack for the per-request calls
    (False: JSON throughout, for tools); ``frames``: every call over the framed protocol."""

    def __init__(
        self, socket_path: str, timeout_s: float = 30.0, msgpack: bool = MSGPACK_DEFAULT,
        frames: bool = False,
    ) -> None:  # fmt: skip
        self.msgpack = msgpack
        self._frames = FrameConn(frames_socket_of(socket_path), timeout_s) if frames else None
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=socket_path, limits=_LIMITS),
            base_url=_BASE,
            timeout=timeout_s,
        )

    def close(self) -> None:
        """Close the connection pool (and the framed connection)."""
        self._http.close()
        if self._frames is not None:
            self._frames.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(
        self, manifest: Manifest, regions: list[AnyRegionSpec], instance: str = ""
    ) -> RegisterResponse:
        """Register the KV manifest and where each region's memory is (once); ``instance``:
        this engine process's own id (``RegisterRequest.instance``)."""
        return self._send(_register(manifest, regions, instance))  # type: ignore[no-any-return]

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return self._send(_hold(req))  # type: ignore[no-any-return]

    def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        self._send(_abort(hold_id))

    def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return self._send(_pull(req))  # type: ignore[no-any-return]

    def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s`` (the sidecar cuts it at 60 s)."""
        return self._send(_pull_status(pull_id, wait_s))  # type: ignore[no-any-return]

    def wait_pull(self, pull_id: str, timeout_s: float) -> PullStatus:
        """The pull's status once done or failed, or its latest after ``timeout_s``."""
        return self._drive(_wait_pull(pull_id, timeout_s))

    def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull and return its final status (one call)."""
        return self._send(_run_pull(req))  # type: ignore[no-any-return]

    def finished_pulls(self, cursor: int = 0, limit: int = 1024) -> FinishedPulls:
        """Pulls finished since ``cursor`` (one page)."""
        return self._send(_finished_pulls(cursor, limit))  # type: ignore[no-any-return]

    def keepalive(self, tickets: list[Ticket], extend_s: float) -> HeartbeatResponse:
        """Extend the prefill holds behind ``tickets`` (requests still queued here)."""
        return self._send(_keepalive(tickets, extend_s))  # type: ignore[no-any-return]

    def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        """Release the prefill holds behind ``tickets`` (this engine will not read them)."""
        return self._send(_decline(tickets, reason))  # type: ignore[no-any-return]

    def released(self, cursor: int = 0, limit: int | None = None) -> ReleasedHolds:
        """One page of holds released since ``cursor`` (``more``: ask again at once)."""
        return self._send(_released(cursor, limit))  # type: ignore[no-any-return]

    def store_save(self, req: StoreSaveRequest) -> StoreSaved:
        """Save a request's blocks to the store."""
        return self._send(_store_save(req))  # type: ignore[no-any-return]

    def store_lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """Tokens of a prompt the store can serve."""
        return self._send(_store_lookup(req))  # type: ignore[no-any-return]

    def store_load(self, req: StoreLoadRequest) -> StoreLoadStatus:
        """Load a prompt's first tokens from the store into local blocks."""
        return self._send(_store_load(req))  # type: ignore[no-any-return]

    def healthz(self) -> None:
        """Return once the sidecar answers its liveness probe (SidecarUnreachableError if not)."""
        self._send(_healthz())

    def unregister(self, generation: int) -> None:
        """Forget the registered memory of ``generation`` (sleep, re-init, restart)."""
        self._send(_unregister(generation))

    def identity(self) -> Identity:
        """Engine id, epoch, generation and peer address of this sidecar."""
        return self._send(_identity())  # type: ignore[no-any-return]

    def _send(self, call: _Call) -> Any:
        if self._frames is not None:
            try:
                return call.frame_result(*self._frames.call(*call.frame_args(), call.timeout_s))
            except FrameLinkError as exc:
                raise SidecarUnreachableError(f"{call.method} {call.path}: {exc}") from exc
        try:
            resp = self._http.request(call.method, call.path, **call.request_args(self.msgpack))
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.ConnectError):
                _close_abandoned_sockets(exc)
            raise SidecarUnreachableError(f"{call.method} {call.path}: {exc!r}") from exc
        return call.result(resp)

    def _drive(self, steps: Generator[_Call, Any, T]) -> T:
        try:
            call = next(steps)
            while True:
                call = steps.send(self._send(call))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


class AsyncEngineClient:
    """asyncio client; the same methods as EngineClient, awaitable. Its calls go to ``lanes``
    small connection pools in turn (kvxferd.lanes), so many calls in flight stay cheap; with
    ``frames`` they share one framed connection instead."""

    def __init__(
        self, socket_path: str, timeout_s: float = 30.0, msgpack: bool = MSGPACK_DEFAULT,
        lanes: int = ASYNC_LANES, frames: bool = False,
    ) -> None:  # fmt: skip
        self.msgpack = msgpack
        self._frames = AsyncFrameConn(frames_socket_of(socket_path), timeout_s) if frames else None

        def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(
                    uds=socket_path, limits=_LIMITS, verify=ssl_context()
                ),
                base_url=_BASE,
                timeout=timeout_s,
            )

        self._lanes = Lanes(make, lanes)

    async def aclose(self) -> None:
        """Close the connection pools (and the framed connection)."""
        for client in self._lanes.made():
            await client.aclose()
        if self._frames is not None:
            await self._frames.aclose()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def register(
        self, manifest: Manifest, regions: list[AnyRegionSpec], instance: str = ""
    ) -> RegisterResponse:
        """Register the KV manifest and where each region's memory is (once); ``instance``:
        this engine process's own id (``RegisterRequest.instance``)."""
        return await self._send(_register(manifest, regions, instance))  # type: ignore[no-any-return]

    async def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return await self._send(_hold(req))  # type: ignore[no-any-return]

    async def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        await self._send(_abort(hold_id))

    async def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return await self._send(_pull(req))  # type: ignore[no-any-return]

    async def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s`` (the sidecar cuts it at 60 s)."""
        return await self._send(_pull_status(pull_id, wait_s))  # type: ignore[no-any-return]

    async def wait_pull(self, pull_id: str, timeout_s: float) -> PullStatus:
        """The pull's status once done or failed, or its latest after ``timeout_s``."""
        return await self._drive(_wait_pull(pull_id, timeout_s))

    async def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull and return its final status (one call)."""
        return await self._send(_run_pull(req))  # type: ignore[no-any-return]

    async def finished_pulls(self, cursor: int = 0, limit: int = 1024) -> FinishedPulls:
        """Pulls finished since ``cursor`` (one page)."""
        return await self._send(_finished_pulls(cursor, limit))  # type: ignore[no-any-return]

    async def keepalive(self, tickets: list[Ticket], extend_s: float) -> HeartbeatResponse:
        """Extend the prefill holds behind ``tickets`` (requests still queued here)."""
        return await self._send(_keepalive(tickets, extend_s))  # type: ignore[no-any-return]

    async def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        """Release the prefill holds behind ``tickets`` (this engine will not read them)."""
        return await self._send(_decline(tickets, reason))  # type: ignore[no-any-return]

    async def released(self, cursor: int = 0, limit: int | None = None) -> ReleasedHolds:
        """One page of holds released since ``cursor`` (``more``: ask again at once)."""
        return await self._send(_released(cursor, limit))  # type: ignore[no-any-return]

    async def unregister(self, generation: int) -> None:
        """Forget the registered memory of ``generation`` (sleep, re-init, restart)."""
        await self._send(_unregister(generation))

    async def identity(self) -> Identity:
        """Engine id, epoch, generation and peer address of this sidecar."""
        return await self._send(_identity())  # type: ignore[no-any-return]

    async def store_save(self, req: StoreSaveRequest) -> StoreSaved:
        """Save a request's blocks to the store."""
        return await self._send(_store_save(req))  # type: ignore[no-any-return]

    async def store_lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """Tokens of a prompt the store can serve."""
        return await self._send(_store_lookup(req))  # type: ignore[no-any-return]

    async def store_load(self, req: StoreLoadRequest) -> StoreLoadStatus:
        """Load a prompt's first tokens from the store into local blocks."""
        return await self._send(_store_load(req))  # type: ignore[no-any-return]

    async def healthz(self) -> None:
        """Return once the sidecar answers its liveness probe (SidecarUnreachableError if not)."""
        await self._send(_healthz())

    async def _send(self, call: _Call) -> Any:
        if self._frames is not None:
            try:
                answer = await self._frames.call(*call.frame_args(), call.timeout_s)
            except FrameLinkError as exc:
                raise SidecarUnreachableError(f"{call.method} {call.path}: {exc}") from exc
            return call.frame_result(*answer)
        try:
            resp = await self._lanes.next().request(
                call.method, call.path, **call.request_args(self.msgpack)
            )
        except httpx.HTTPError as exc:
            raise SidecarUnreachableError(f"{call.method} {call.path}: {exc!r}") from exc
        return call.result(resp)

    async def _drive(self, steps: Generator[_Call, Any, T]) -> T:
        try:
            call = next(steps)
            while True:
                call = steps.send(await self._send(call))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
