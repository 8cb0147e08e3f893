"""msgspec at the HTTP edge: typed request decoding, Struct responses, errors as ErrorBody.

FastAPI cannot build models from msgspec Structs, so handlers take the raw body and decode it
here; a decode failure becomes a 422 naming the offending field (msgspec's ``$.path``).
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
    (errors.HoldExpiredError, 410),
    (errors.IncompatiblePeerError, 409),
    (errors.DuplicateHoldError, 409),
    (errors.HoldRequestError, 422),
    (errors.StateError, 409),
    (errors.BlockIdError, 422),
    (errors.ManifestError, 422),
    (errors.MemoryRegionError, 422),
    (errors.ConfigError, 400),
    (errors.HandshakeError, 502),
    (errors.TransportError, 502),
    (errors.KvxferdError, 400),
]
_FIELD = re.compile(r"at `\$\.?([^`]*)`")


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
        match = _FIELD.search(str(exc))
        field = match.group(1) if match else ""
        body = ErrorBody(error="ValidationError", detail=str(exc), field=field)
        raise HTTPProblem(422, body) from None
    except msgspec.DecodeError as exc:
        raise HTTPProblem(400, ErrorBody(error="DecodeError", detail=str(exc))) from None


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
