"""OpenAI-style error replies for what can go wrong between the proxy and its backends.

A client of the proxy always gets ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status, never a hang: unreachable or slow backends, and answers too large to hold, become
502/504 naming the URL and the reason; a backend that answered an error has its status and body
passed through unchanged.
"""

from __future__ import annotations

import httpx
from fastapi.responses import JSONResponse

from kvxferd.proxy.routing import Backend


def error_response(
    status: int, message: str, kind: str, param: str | None = None, request_id: str | None = None
) -> JSONResponse:
    """One OpenAI-shaped error object with ``status`` (and the request's ``X-Request-Id``, as
    every answer of the P/D path carries)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {"X-Request-Id": request_id} if request_id else None
    return JSONResponse(body, status_code=status, headers=headers)


class BackendTimeout(TimeoutError):
    """A phase of a backend call (``connect``, ``first byte``, ``idle``) ran past its bound."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(f"no {phase} within {seconds:g} s")
        self.phase = phase
        self.seconds = seconds


class AnswerTooLarge(Exception):
    """A backend answer the proxy reads whole ran past ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answer over {limit} bytes")
        self.limit = limit


BACKEND_ERRORS = (httpx.HTTPError, TimeoutError, AnswerTooLarge)
"""What a backend call (or the reading of its answer) raises when it fails."""


def describe_failure(exc: BaseException) -> str:
    """A short reason for a failed backend call (the exception type says timeout vs refused)."""
    if isinstance(exc, BackendTimeout):
        return f"timed out: {exc}"
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, AnswerTooLarge):
        return str(exc)
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def unreachable(
    backend: Backend, exc: BaseException, timeout_s: float, request_id: str | None = None
) -> JSONResponse:
    """502 for a backend that could not be reached or did not answer within ``timeout_s``."""
    reason = describe_failure(exc)
    if isinstance(exc, httpx.ConnectTimeout):
        reason += " (connect)"
    elif isinstance(exc, TimeoutError | httpx.TimeoutException) and not isinstance(
        exc, BackendTimeout
    ):
        reason += f" after {timeout_s:g} s"
    what = "failed" if isinstance(exc, AnswerTooLarge) else "unreachable"
    message = f"{backend.role} backend {backend.url} {what}: {reason}"
    return error_response(502, message, "bad_gateway", request_id=request_id)


def bad_backend_reply(backend: Backend, what: str, request_id: str | None = None) -> JSONResponse:
    """502 for a backend that answered 2xx but not what the P/D protocol needs."""
    message = f"{backend.role} backend {backend.url}: {what}"
    return error_response(502, message, "bad_gateway", request_id=request_id)
