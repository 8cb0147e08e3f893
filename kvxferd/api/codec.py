"""msgspec at the HTTP edge: typed request decoding, Struct responses, errors as ErrorBody.

FastAPI cannot build models from msgspec Structs, so handlers take the raw body and decode it
here. A body that is not JSON is a 400; a body of the wrong shape is a 422 whose ErrorBody
``field`` is the offending path (``block_ids[0][1]``, ``manifest.regions[0].size_bytes``) and
whose ``detail`` is ``"<field>: <what is wrong>"``, the field named once.

Where an app allows it (the engine API), the same Structs also travel as MessagePack: a body
sent with ``Content-Type: application/msgpack`` is decoded as msgpack, and a request that says
``Accept: application/msgpack`` is answered in msgpack, errors included (:class:`Negotiated`).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvxferd import errors
from kvxferd.wire import ErrorBody, one_line

T = TypeVar("T")

MSGPACK = "application/msgpack"
"""Media type of MessagePack bodies and answers (the engine API's lean path)."""
_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}

_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.DOTALL)
_NAMED = [
    (re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$"), "unknown field"),
    (re.compile(r"^Object missing required field `(?P<name>[^`]+)`$"), "missing required field"),
]


class StructResponse(Response):
    """A JSON response whose content is a msgspec Struct (or any msgspec-encodable value)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return _encoder.encode(content)


class MsgpackResponse(Response):
    """A MessagePack response whose content is a msgspec Struct (or any encodable value)."""

    media_type = MSGPACK

    def render(self, content: Any) -> bytes:
        return _msgpack_encoder.encode(content)


class Negotiated:
    """The formats of one exchange: how its body is decoded and its answer encoded.

    JSON unless the app allows msgpack and the request asks for it (Content-Type for the body,
    Accept for the answer); the two are independent."""

    __slots__ = ("body_msgpack", "answer_msgpack")

    def __init__(self, body_msgpack: bool = False, answer_msgpack: bool = False) -> None:
        self.body_msgpack = body_msgpack
        self.answer_msgpack = answer_msgpack

    @classmethod
    def of(cls, request: Request, allow_msgpack: bool) -> Negotiated:
        """The formats ``request`` asks for (always JSON where msgpack is not allowed)."""
        if not allow_msgpack:
            return JSON_ONLY
        headers = request.headers
        body = headers.get("content-type", "").startswith(MSGPACK)
        answer = MSGPACK in headers.get("accept", "")
        return _NEGOTIATED[body, answer]

    def response(self, content: Any, status_code: int = 200) -> Response:
        """The answer ``content`` in the negotiated format."""
        if self.answer_msgpack:
            return MsgpackResponse(content, status_code=status_code)
        return StructResponse(content, status_code=status_code)


JSON_ONLY = Negotiated()
"""Plain JSON both ways (tools, the peer API)."""
_NEGOTIATED = {(b, a): Negotiated(b, a) for b in (False, True) for a in (False, True)}


class HTTPProblem(Exception):
    """An error answer with its status and body, raised by handlers and decode_body()."""

    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(body.detail)
        self.status = status
        self.body = body


def decode_body(body: bytes, kind: type[T], wire: Negotiated = JSON_ONLY) -> T:
    """Decode a request body (HTTP's, or a frame's) as ``kind`` (JSON, or msgpack where ``wire``
    says so) or raise a 400 (not JSON/msgpack) or 422 (wrong shape, naming the field)
    HTTPProblem."""
    decoder: msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any] | None
    if wire.body_msgpack:
        decoder = _msgpack_decoders.get(kind)
        if decoder is None:
            decoder = _msgpack_decoders[kind] = msgspec.msgpack.Decoder(kind)
        what = "msgpack"
    else:
        decoder = _decoders.get(kind)
        if decoder is None:
            decoder = _decoders[kind] = msgspec.json.Decoder(kind)
        what = "JSON"
    try:
        return decoder.decode(body)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise HTTPProblem(422, validation_body(str(exc))) from None
    except msgspec.DecodeError as exc:
        detail = str(exc) if what == "JSON" else f"msgpack body: {exc}"
        raise HTTPProblem(400, ErrorBody(error="DecodeError", detail=detail)) from None
    except RecursionError:
        # msgspec decodes nested values (and skips unknown fields) recursively, bounded by
        # Python's recursion limit: a body nested ~1,000 deep ends here, not in a 500.
        detail = f"{what} nested too deeply (no kvxferd message nests beyond a few levels)"
        raise HTTPProblem(400, ErrorBody(error="DecodeError", detail=detail)) from None


def validation_body(message: str) -> ErrorBody:
    """ErrorBody of a msgspec validation message: the JSON path as ``field``, named once (an
    unknown field's name is the caller's text: written on one line, escaped)."""
    match = _AT.match(one_line(message))
    assert match is not None  # the pattern matches any string
    text, path = match["message"], match["path"] or ""
    for pattern, reason in _NAMED:
        named = pattern.match(text)
        if named:
            path = f"{path}.{named['name']}" if path else named["name"]
            text = reason
            break
    detail = f"{path}: {text}" if path else text
    return ErrorBody(error="ValidationError", detail=detail, field=path)


def problem_for(exc: Exception) -> HTTPProblem:
    """Translate a kvxferd error into its HTTP answer (500 for anything unexpected)."""
    if isinstance(exc, HTTPProblem):
        return exc
    if isinstance(exc, errors.KvxferdError):  # the status comes from the error tree
        field = getattr(exc, "field", "") or ""
        if isinstance(exc, errors.IncompatiblePeerError):
            field = ",".join(exc.fields)
        body = ErrorBody(error=type(exc).__name__, detail=str(exc), field=field)
        return HTTPProblem(errors.status_of(exc), body)
    return HTTPProblem(500, ErrorBody(error="InternalError", detail=f"{type(exc).__name__}: {exc}"))


def problem_response(exc: Exception, wire: Negotiated = JSON_ONLY) -> Response:
    """The Response for an exception raised by a handler (an ErrorBody in ``wire``'s format)."""
    problem = problem_for(exc)
    headers = {"WWW-Authenticate": "KVX1"} if problem.status == 401 else None
    if wire.answer_msgpack:
        return MsgpackResponse(problem.body, status_code=problem.status, headers=headers)
    return JSONResponse(
        msgspec.to_builtins(problem.body), status_code=problem.status, headers=headers
    )


def auth_problem(exc: errors.AuthError) -> ErrorBody:
    """The 401 body of a refused signature (a SignedBeforeStartError names ``ts`` and the
    earliest one accepted)."""
    if isinstance(exc, errors.SignedBeforeStartError):
        return ErrorBody(error="SignedBeforeStartError", detail=str(exc),
                         field="Authorization.ts", not_before=exc.not_before)  # fmt: skip
    return ErrorBody(error="AuthError", detail=str(exc))
