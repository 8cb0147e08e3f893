"""msgspec at the HTTP edge: typed request decoding, Struct responses, errors as ErrorBody.

FastAPI cannot build models from msgspec Structs, so handlers take the raw body and decode it
here. A body that is not JSON is a 400; a body of the wrong shape is a 422 whose ErrorBody
``field`` is the offending path (``block_ids[0][1]``, ``manifest.regions[0].size_bytes``) and
whose ``detail`` is ``"<field>: <what is wrong>"``, the field named once.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvxferd import errors
from kvxferd.wire import ErrorBody

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}

# Exception type -> HTTP status. Checked in order, so subclasses come before their bases.
_STATUS: list[tuple[type[Exception], int]] = [
    (errors.AuthError, 401),
    (errors.UnknownHoldError, 404),
    (errors.UnknownPullError, 404),
    (errors.NotRegisteredError, 503),
    (errors.AlreadyRegisteredError, 409),
    (errors.HoldExpiredError, 410),
    (errors.IncompatiblePeerError, 409),
    (errors.DuplicateHoldError, 409),
    (errors.HoldRequestError, 422),
    (errors.StateError, 409),
    (errors.BlockIdError, 422),
    (errors.ManifestError, 422),
    (errors.MemoryRegionError, 422),
    (errors.StoreError, 422),
    (errors.ConfigError, 500),  # at request time: the server's own settings are wrong
    (errors.HandshakeError, 502),
    (errors.TransportError, 502),
    (errors.KvxferdError, 400),
]
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


class HTTPProblem(Exception):
    """An error answer with its status and body, raised by handlers and decode()."""

    def __init__(self, status: int, body: ErrorBody) -> None:
        super().__init__(body.detail)
        self.status = status
        self.body = body


async def decode(request: Request, kind: type[T]) -> T:
    """Decode the request body as ``kind`` or raise a 422 HTTPProblem naming the field."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    body = await request.body()
    try:
        return decoder.decode(body)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise HTTPProblem(422, validation_body(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise HTTPProblem(400, ErrorBody(error="DecodeError", detail=str(exc))) from None


def validation_body(message: str) -> ErrorBody:
    """ErrorBody of a msgspec validation message: the JSON path as ``field``, named once."""
    match = _AT.match(message)
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
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            field = getattr(exc, "field", "") or ""
            if isinstance(exc, errors.IncompatiblePeerError):
                field = ",".join(exc.fields)
            body = ErrorBody(error=type(exc).__name__, detail=str(exc), field=field)
            return HTTPProblem(status, body)
    return HTTPProblem(500, ErrorBody(error="InternalError", detail=f"{type(exc).__name__}: {exc}"))


def problem_response(exc: Exception) -> Response:
    """The Response for an exception raised by a handler."""
    problem = problem_for(exc)
    headers = {"WWW-Authenticate": "Bearer"} if problem.status == 401 else None
    return JSONResponse(
        msgspec.to_builtins(problem.body), status_code=problem.status, headers=headers
    )
