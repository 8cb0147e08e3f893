"""Engine-side client of the sidecar's engine API (httpx over the Unix socket).

``EngineClient`` (sync) and ``AsyncEngineClient`` take and return wire Structs. Both are thin
drivers of one I/O-free core, :mod:`kvxferd.calls`: each operation is a ``Call`` (what to send,
what the answer decodes to), and multi-step operations (``wait_pull``) are generators of calls,
so the two classes cannot drift apart.

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

import os
import socket
import stat
from collections.abc import Generator
from typing import Any, TypeVar

import httpx

from kvxferd import calls
from kvxferd.calls import (
    MSGPACK,
    POLL_SLICE_S,
    Call,
    SidecarError,
    SidecarUnreachableError,
    error_for,
)
from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S, frames_socket_of
from kvxferd.frameconn import AsyncFrameConn, FrameConn, FrameLinkError
from kvxferd.lanes import ASYNC_LANES, Lanes, ssl_context
from kvxferd.wire import (
    AnyRegionSpec,
    DeclineResponse,
    FinishedPulls,
    HeartbeatResponse,
    HoldRequest,
    Identity,
    Manifest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterResponse,
    ReleasedHolds,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookup,
    StoreLookupRequest,
    StoreSaved,
    StoreSaveRequest,
    Ticket,
)

__all__ = [
    "MSGPACK",
    "MSGPACK_DEFAULT",
    "POLL_SLICE_S",
    "AsyncEngineClient",
    "EngineClient",
    "SidecarError",
    "SidecarUnreachableError",
    "error_for",
    "frames_available",
]

T = TypeVar("T")
_BASE = "http://kvxferd"
_LIMITS = httpx.Limits(keepalive_expiry=HTTP_CLIENT_KEEPALIVE_S)
MSGPACK_DEFAULT = True
"""Whether clients use MessagePack for the per-request calls unless told otherwise
(scripts/bench_engine_wire.py measures it against JSON)."""


def frames_available(socket_path: str) -> bool:
    """Whether the sidecar at ``socket_path`` serves frames at the default place (a socket
    file exists there)."""
    try:
        return stat.S_ISSOCK(os.stat(frames_socket_of(socket_path)).st_mode)
    except OSError:
        return False


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
        self.timeout_s = timeout_s
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
        return self._send(calls.register(manifest, regions, instance))  # type: ignore[no-any-return]

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return self._send(calls.hold(req, self.timeout_s))  # type: ignore[no-any-return]

    def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        self._send(calls.abort(hold_id))

    def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return self._send(calls.pull(req))  # type: ignore[no-any-return]

    def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s`` (the sidecar cuts it at 60 s)."""
        return self._send(calls.pull_status(pull_id, wait_s))  # type: ignore[no-any-return]

    def wait_pull(self, pull_id: str, timeout_s: float) -> PullStatus:
        """The pull's status once done or failed, or its latest after ``timeout_s``."""
        return self._drive(calls.wait_pull(pull_id, timeout_s))

    def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull and return its final status (one call)."""
        return self._send(calls.run_pull(req))  # type: ignore[no-any-return]

    def finished_pulls(self, cursor: int = 0, limit: int = 1024) -> FinishedPulls:
        """Pulls finished since ``cursor`` (one page)."""
        return self._send(calls.finished_pulls(cursor, limit))  # type: ignore[no-any-return]

    def keepalive(self, tickets: list[Ticket], extend_s: float) -> HeartbeatResponse:
        """Extend the prefill holds behind ``tickets`` (requests still queued here)."""
        return self._send(calls.keepalive(tickets, extend_s))  # type: ignore[no-any-return]

    def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        """Release the prefill holds behind ``tickets`` (this engine will not read them)."""
        return self._send(calls.decline(tickets, reason))  # type: ignore[no-any-return]

    def released(self, cursor: int = 0, limit: int | None = None) -> ReleasedHolds:
        """One page of holds released since ``cursor`` (``more``: ask again at once)."""
        return self._send(calls.released(cursor, limit))  # type: ignore[no-any-return]

    def store_save(self, req: StoreSaveRequest) -> StoreSaved:
        """Save a request's blocks to the store."""
        return self._send(calls.store_save(req))  # type: ignore[no-any-return]

    def store_lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """Tokens of a prompt the store can serve."""
        return self._send(calls.store_lookup(req))  # type: ignore[no-any-return]

    def store_load(self, req: StoreLoadRequest) -> StoreLoadStatus:
        """Load a prompt's first tokens from the store into local blocks."""
        return self._send(calls.store_load(req))  # type: ignore[no-any-return]

    def healthz(self) -> None:
        """Return once the sidecar answers its liveness probe (SidecarUnreachableError if not)."""
        self._send(calls.healthz())

    def unregister(self, generation: int) -> None:
        """Forget the registered memory of ``generation`` (sleep, re-init, restart)."""
        self._send(calls.unregister(generation))

    def identity(self) -> Identity:
        """Engine id, epoch, generation and peer address of this sidecar."""
        return self._send(calls.identity())  # type: ignore[no-any-return]

    def _send(self, call: Call) -> Any:
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

    def _drive(self, steps: Generator[Call, Any, T]) -> T:
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
        self.timeout_s = timeout_s
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
        return await self._send(calls.register(manifest, regions, instance))  # type: ignore[no-any-return]

    async def hold(self, req: HoldRequest) -> Ticket:
        """Pin blocks of a prefilled request; returns its ticket."""
        return await self._send(calls.hold(req, self.timeout_s))  # type: ignore[no-any-return]

    async def abort(self, hold_id: str) -> None:
        """Give up a hold."""
        await self._send(calls.abort(hold_id))

    async def pull(self, req: PullRequest) -> PullAccepted:
        """Start a pull."""
        return await self._send(calls.pull(req))  # type: ignore[no-any-return]

    async def pull_status(self, pull_id: str, wait_s: float = 0.0) -> PullStatus:
        """A pull's status, long-polling up to ``wait_s`` (the sidecar cuts it at 60 s)."""
        return await self._send(calls.pull_status(pull_id, wait_s))  # type: ignore[no-any-return]

    async def wait_pull(self, pull_id: str, timeout_s: float) -> PullStatus:
        """The pull's status once done or failed, or its latest after ``timeout_s``."""
        return await self._drive(calls.wait_pull(pull_id, timeout_s))

    async def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull and return its final status (one call)."""
        return await self._send(calls.run_pull(req))  # type: ignore[no-any-return]

    async def finished_pulls(self, cursor: int = 0, limit: int = 1024) -> FinishedPulls:
        """Pulls finished since ``cursor`` (one page)."""
        return await self._send(calls.finished_pulls(cursor, limit))  # type: ignore[no-any-return]

    async def keepalive(self, tickets: list[Ticket], extend_s: float) -> HeartbeatResponse:
        """Extend the prefill holds behind ``tickets`` (requests still queued here)."""
        return await self._send(calls.keepalive(tickets, extend_s))  # type: ignore[no-any-return]

    async def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        """Release the prefill holds behind ``tickets`` (this engine will not read them)."""
        return await self._send(calls.decline(tickets, reason))  # type: ignore[no-any-return]

    async def released(self, cursor: int = 0, limit: int | None = None) -> ReleasedHolds:
        """One page of holds released since ``cursor`` (``more``: ask again at once)."""
        return await self._send(calls.released(cursor, limit))  # type: ignore[no-any-return]

    async def unregister(self, generation: int) -> None:
        """Forget the registered memory of ``generation`` (sleep, re-init, restart)."""
        await self._send(calls.unregister(generation))

    async def identity(self) -> Identity:
        """Engine id, epoch, generation and peer address of this sidecar."""
        return await self._send(calls.identity())  # type: ignore[no-any-return]

    async def store_save(self, req: StoreSaveRequest) -> StoreSaved:
        """Save a request's blocks to the store."""
        return await self._send(calls.store_save(req))  # type: ignore[no-any-return]

    async def store_lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """Tokens of a prompt the store can serve."""
        return await self._send(calls.store_lookup(req))  # type: ignore[no-any-return]

    async def store_load(self, req: StoreLoadRequest) -> StoreLoadStatus:
        """Load a prompt's first tokens from the store into local blocks."""
        return await self._send(calls.store_load(req))  # type: ignore[no-any-return]

    async def healthz(self) -> None:
        """Return once the sidecar answers its liveness probe (SidecarUnreachableError if not)."""
        await self._send(calls.healthz())

    async def _send(self, call: Call) -> Any:
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

    async def _drive(self, steps: Generator[Call, Any, T]) -> T:
        try:
            call = next(steps)
            while True:
                call = steps.send(await self._send(call))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
