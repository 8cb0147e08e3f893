"""One route table per app: each Operation is both served (mount) and documented (openapi).

An Operation names its method, path, typed body and answer, query parameters and the error
statuses it may answer. ``mount`` turns the table into FastAPI routes whose single endpoint
decodes, authorises, calls the handler, encodes, and turns every exception into an ErrorBody,
so the route table and the OpenAPI documents cannot disagree. The framed protocol
(kvxferd.api.frames) serves the same table through the same :func:`invoke` and :func:`failed`.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvxferd.api.codec import (
    HTTPProblem,
    Negotiated,
    decode_body,
    problem_for,
    problem_response,
)
from kvxferd.errors import KvxferdError, NotRegisteredError
from kvxferd.wire import ErrorBody

log = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]
NOT_REGISTERED = "no engine has registered with this sidecar yet"
_PATH_PARAM = re.compile(r"{(\w+)}")


@dataclass(frozen=True)
class Query:
    """A query-string parameter: name, msgspec type (constraints via ``Meta``), default, meaning."""

    name: str
    kind: Any
    default: Any
    doc: str


@dataclass(frozen=True)
class Operation:
    """One HTTP operation of an app.

    ``handler`` is called as ``handler(target, body, **path_params, **query)`` (no ``body``
    without a ``request`` type), ``target`` being the object the app serves (the Sidecar), and
    returns the answer; ``None`` for entries served by a mounted ASGI app (documentation only).
    The handler's docstring is the operation's summary and description.
    """

    method: str
    path: str
    handler: Handler | None
    request: type | None = None
    response: type | dict[str, Any] | None = None
    status: int = 200
    errors: tuple[int, ...] = ()
    query: tuple[Query, ...] = ()
    auth: bool = False
    needs_engine: bool = False
    media_type: str = "application/json"
    name: str = ""
    doc: str = ""

    @property
    def operation_id(self) -> str:
        """Stable id of the operation (the handler's name unless given)."""
        return self.name or getattr(self.handler, "__name__", "") or _slug(self.path)

    @property
    def summary(self) -> str:
        """First paragraph of the handler docstring (or of ``doc``), on one line: a sentence
        that wraps is not cut."""
        return " ".join(self.description.split("\n\n", 1)[0].split())

    @property
    def description(self) -> str:
        """The handler docstring (or ``doc``), dedented."""
        return inspect.cleandoc(self.doc or inspect.getdoc(self.handler) or "")

    @property
    def path_params(self) -> list[str]:
        """Names of ``{param}`` segments of the path."""
        return _PATH_PARAM.findall(self.path)


@dataclass
class Gate:
    """Per-app checks run before decoding: a registered engine and the request's signature."""

    ready: Callable[[], bool] = field(default=lambda: True)
    authorize: Callable[[Request], Awaitable[None] | None] | None = None
    """HTTP: admits a request of an operation with ``auth`` (raises HTTPProblem 401)."""
    verify: Callable[[str, str, bytes, str], None] | None = None
    """Frames: ``verify(method, target, body, signature)`` admits a request of an operation with
    ``auth`` (raises AuthError); the same check as ``authorize``, minus HTTP."""
    msgpack: bool = False
    """Bodies and answers may also be MessagePack (Content-Type / Accept: application/msgpack)."""


def mount(app: FastAPI, operations: list[Operation], target: object, gate: Gate) -> None:
    """Serve ``operations`` of ``target`` on ``app``; routing errors answer an ErrorBody too."""
    if gate.authorize is None and any(op.auth for op in operations):
        raise ValueError("operations need a token but the gate has no authorize check")
    for op in operations:
        if op.handler is None:
            continue
        # A plain Starlette route: FastAPI's per-route machinery (dependency solving, its own
        # request wrapper) cost ~100 us a call, and the endpoint decodes and encodes itself.
        app.add_route(
            op.path,
            _endpoint(op, target, gate),
            methods=[op.method],
            name=op.operation_id,
            include_in_schema=False,
        )

    async def http_exception(request: Request, exc: Exception) -> Response:
        return _http_exception(exc, Negotiated.of(request, gate.msgpack))

    async def last_resort(request: Request, exc: Exception) -> Response:
        """Anything that escaped an endpoint (middleware, mounted apps): a 500 ErrorBody."""
        return problem_response(problem_for(exc), Negotiated.of(request, gate.msgpack))

    app.add_exception_handler(StarletteHTTPException, http_exception)
    app.add_exception_handler(Exception, last_resort)


def _endpoint(
    op: Operation, target: object, gate: Gate
) -> Callable[[Request], Awaitable[Response]]:
    assert op.handler is not None

    async def endpoint(request: Request) -> Response:
        wire = Negotiated.of(request, gate.msgpack)
        try:
            if op.auth:
                checked = gate.authorize(request)  # type: ignore[misc]  # checked by mount()
                if inspect.isawaitable(checked):  # a check that reads the body (signatures)
                    await checked
            body = await request.body() if op.request is not None else b""
            result = await invoke(
                op, target, gate, body, wire, request.path_params, request.query_params
            )
        except Exception as exc:
            return problem_response(failed(op, exc), wire)
        if isinstance(result, Response):
            return result
        if result is None:
            return Response(status_code=op.status)
        return wire.response(result, op.status)

    endpoint.__name__ = op.operation_id
    endpoint.__doc__ = op.description
    return endpoint


async def invoke(
    op: Operation, target: object, gate: Gate, body: bytes, wire: Negotiated,
    path_params: Mapping[str, str], query: Mapping[str, Any],
) -> Any:  # fmt: skip
    """Run one call of ``op`` once its caller is authorised: the engine gate, the typed body
    (400/422 naming the field), the typed query (422 naming the parameter), the handler. Shared by
    the HTTP endpoints and the framed protocol (kvxferd.api.frames), so both answer alike."""
    assert op.handler is not None
    if op.needs_engine and not gate.ready():
        raise NotRegisteredError(NOT_REGISTERED)
    args: list[Any] = [target]
    if op.request is not None:
        args.append(decode_body(body, op.request, wire))
    kwargs: dict[str, Any] = {name: path_params[name] for name in op.path_params}
    kwargs.update(_query(query, op.query))
    return await op.handler(*args, **kwargs)


def failed(op: Operation, exc: Exception) -> HTTPProblem:
    """The error answer of a call that raised ``exc``; anything unexpected is logged (a 500)."""
    if not isinstance(exc, HTTPProblem | KvxferdError):
        log.error("%s %s failed unexpectedly", op.method, op.path, exc_info=exc)
    return problem_for(exc)


def _query(query: Mapping[str, Any], params: tuple[Query, ...]) -> dict[str, Any]:
    """Typed query parameters; a bad value is a 422 naming the parameter."""
    out: dict[str, Any] = {}
    for param in params:
        raw = query.get(param.name)
        if raw is None:
            out[param.name] = param.default
            continue
        try:
            out[param.name] = msgspec.convert(raw, param.kind, strict=False)
        except msgspec.ValidationError as exc:
            body = ErrorBody(
                error="ValidationError", detail=f"{param.name}: {exc}", field=param.name
            )
            raise HTTPProblem(422, body) from None
    return out


def _http_exception(exc: Exception, wire: Negotiated) -> Response:
    """Routing errors (unknown path 404, wrong method 405) as ErrorBody, headers kept."""
    assert isinstance(exc, StarletteHTTPException)
    name = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
    problem = HTTPProblem(exc.status_code, ErrorBody(error=name, detail=str(exc.detail)))
    response = problem_response(problem, wire)
    response.headers.update(exc.headers or {})
    return response


def _slug(path: str) -> str:
    return re.sub(r"\W+", "_", path).strip("_")
