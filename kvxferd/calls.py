"""The I/O-free core of the engine client: what each engine call sends, and what its answer
decodes to (or the error it raises).

Each operation is a :class:`Call`; a multi-step operation (:func:`wait_pull`) is a generator of
calls. :mod:`kvxferd.client` drives them over HTTP or frames, blocking or async, so its two
clients cannot drift apart. A call that touches the engine's memory carries the time past which
it must not act (``not_after_ns``, :func:`stamped`): the engine gives it up then.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvxferd import errors
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
Stamped = TypeVar("Stamped", HoldRequest, PullRequest, StoreSaveRequest, StoreLoadRequest)
_NS_MAX = 2**63 - 1
POLL_SLICE_S = 30.0
"""Longest single long-poll of wait_pull (the sidecar cuts ``wait`` at 60 s anyway)."""
_POLL_MARGIN_S = 10.0  # HTTP timeout of a long poll beyond its wait
_RUN_MARGIN_S = 15.0  # HTTP timeout of a run pull beyond its deadline (READs settling)
_FINAL = ("done", "failed")
MSGPACK = "application/msgpack"
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


@dataclass(frozen=True)
class Call:
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


def _is_msgpack(resp: httpx.Response) -> bool:
    return resp.headers.get("content-type", "").startswith(MSGPACK)


def _msgpack_decoder(kind: type) -> msgspec.msgpack.Decoder[Any]:
    decoder = _msgpack_decoders.get(kind)
    if decoder is None:
        decoder = _msgpack_decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder


def register(manifest: Manifest, regions: list[AnyRegionSpec], instance: str = "") -> Call:
    req = RegisterRequest(manifest=manifest, regions=regions, instance=instance)
    return Call("POST", "/v1/register", RegisterResponse, req)


def stamped(req: Stamped, act_s: float) -> Stamped:
    """``req`` with ``not_after_ns`` ``act_s`` seconds from now: the engine gives the call up
    by then and may free its blocks, so a sidecar that reads it later must not act on it. One
    the caller set stays; an ``act_s`` that is no time (NaN, <= 0) is left to the sidecar's 422."""
    if req.not_after_ns or not (math.isfinite(act_s) and act_s > 0):
        return req
    not_after = min(_NS_MAX, time.monotonic_ns() + round(act_s * 1e9))
    return msgspec.structs.replace(req, not_after_ns=not_after)


def hold(req: HoldRequest, timeout_s: float) -> Call:  # given up once its answer is late
    return Call("POST", "/v1/holds", Ticket, stamped(req, timeout_s), lean=True)


def abort(hold_id: str) -> Call:
    return Call("POST", "/v1/holds/abort", None, AbortHoldRequest(hold_id=hold_id), lean=True)


def pull(req: PullRequest) -> Call:  # ends by its deadline from now, however late it comes
    return Call("POST", "/v1/pulls", PullAccepted, stamped(req, req.deadline_s), lean=True)


def pull_status(pull_id: str, wait_s: float) -> Call:
    wait_s = max(0.0, wait_s)
    path = f"/v1/pulls/{quote(pull_id, safe='')}"
    return Call("GET", path, PullStatus, params={"wait": wait_s},
                 timeout_s=wait_s + _POLL_MARGIN_S, lean=True)  # fmt: skip


def run_pull(req: PullRequest) -> Call:  # answered by its deadline + its READs' settling
    return Call("POST", "/v1/pulls/run", PullStatus, stamped(req, req.deadline_s),
                timeout_s=req.deadline_s + _RUN_MARGIN_S, lean=True)  # fmt: skip


def finished_pulls(cursor: int, limit: int) -> Call:
    return Call("GET", "/v1/pulls/finished", FinishedPulls,
                 params={"cursor": cursor, "limit": limit}, lean=True)  # fmt: skip


def keepalive(tickets: list[Ticket], extend_s: float) -> Call:
    req = KeepaliveRequest(tickets=tickets, extend_s=extend_s)
    return Call("POST", "/v1/keepalive", HeartbeatResponse, req, lean=True)


def decline(tickets: list[Ticket], reason: str) -> Call:
    req = DeclineRequest(tickets=tickets, reason=reason)
    return Call("POST", "/v1/decline", DeclineResponse, req, lean=True)


def unregister(generation: int) -> Call:
    return Call("POST", "/v1/unregister", None, UnregisterRequest(generation=generation))


def identity() -> Call:
    return Call("GET", "/v1/identity", Identity)


def healthz() -> Call:
    return Call("GET", "/healthz")


def released(cursor: int, limit: int | None = None) -> Call:
    params = {"cursor": cursor} if limit is None else {"cursor": cursor, "limit": limit}
    return Call("GET", "/v1/released", ReleasedHolds, params=params, lean=True)


def store_save(req: StoreSaveRequest) -> Call:  # answered by its deadline + the last writes
    return Call("POST", "/v1/store/save", StoreSaved, stamped(req, STORE_SAVE_DEADLINE_S),
                lean=True, timeout_s=STORE_SAVE_DEADLINE_S + _RUN_MARGIN_S)  # fmt: skip


def store_lookup(req: StoreLookupRequest) -> Call:
    return Call("POST", "/v1/store/lookup", StoreLookup, req, lean=True)


def store_load(req: StoreLoadRequest) -> Call:  # answered by its deadline + a chunk's copy
    return Call("POST", "/v1/store/load", StoreLoadStatus, stamped(req, req.deadline_s),
                lean=True, timeout_s=req.deadline_s + _RUN_MARGIN_S)  # fmt: skip


def wait_pull(
    pull_id: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
) -> Generator[Call, PullStatus, PullStatus]:
    """Long-poll a pull in slices until it is done or failed, or ``timeout_s`` has passed."""
    end = clock() + timeout_s
    while True:
        left = end - clock()
        status = yield pull_status(pull_id, min(left, POLL_SLICE_S))
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
