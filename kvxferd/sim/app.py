"""The simulated engine's HTTP app: OpenAI-compatible routes plus ``/health`` and ``/v1/stats``.

Thin: parse (400/404 naming the field), run the engine, shape the reply (JSON or SSE). An
error's status is its class's ``status`` in kvxferd.errors (pool exhausted 503, pull or hold
through a sidecar failed 502); an httpx error (a sidecar unreachable) is a 502 too.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvxferd.api.direct import DirectApp
from kvxferd.errors import InvalidRequestError, KvxferdError, PullError, status_of
from kvxferd.proxy.app import RELEASE_PATH
from kvxferd.sim.engine import Prompt, SimEngine
from kvxferd.sim.protocol import (
    Kind,
    Reply,
    error_body,
    parse,
    raw_transfer_params,
    release_params,
)
from kvxferd.wire import REQUEST_ID_MAX_LENGTH, RequestId

log = logging.getLogger(__name__)

_SUFFIX = "-" + "0" * 8
"""A stand-in for what our request id adds to the client's: ``-`` and 8 hex digits (``_serve``)."""


def sim_app(engine: SimEngine, served_model: str) -> DirectApp:
    """The app of one simulated engine serving ``served_model``."""
    app = DirectApp(title="kvxferd sim", docs_url=None, redoc_url=None)
    role = engine.settings.role

    @app.get("/health")
    async def health() -> Response:
        problem = engine.problem()
        if problem:
            return JSONResponse(error_body(503, problem), status_code=503)
        return JSONResponse({"status": "ok", "role": role})

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": served_model, "object": "model", "created": 0, "owned_by": "kvxferd",
                "root": served_model, "max_model_len": None}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/v1/stats")
    async def stats() -> Response:
        return JSONResponse(engine.snapshot())

    @app.post_direct("/v1/completions")  # no FastAPI stack (kvxferd.api.direct)
    async def completions(request: Request) -> Response:
        return await _serve(engine, served_model, request, "completion")

    @app.post_direct("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve(engine, served_model, request, "chat")

    @app.post(RELEASE_PATH)
    async def release(request: Request) -> Response:
        """A prefill's holds for a decode that will not read them (the proxy says so): abort
        them now. Body: ``{"kv_transfer_params": <what this prefill answered>}``. A request it
        does not know is ``{"released": 0}``, never a 404: the proxy reads a 404 as no route."""
        try:
            params = release_params(await request.body())
            ranks = await engine.give_up(params)
        except Exception as exc:
            return _error(exc, {})
        return JSONResponse({"released": ranks})

    return app


async def _serve(engine: SimEngine, model: str, request: Request, kind: Kind) -> Response:
    engine.stats.requests += 1
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    body = await request.body()
    try:
        _check_request_id(rid)
        parsed = parse(kind, body, model)
    except InvalidRequestError as exc:  # refused before the engine saw it: free the prefill
        engine.stats.requests_failed += 1
        engine.decline_params(raw_transfer_params(body), f"rejected: {exc.field}")
        return _error(exc, headers)
    try:
        prompt = Prompt(
            tokens=parsed.tokens,
            max_tokens=parsed.max_tokens,
            request_id=f"{rid}-{uuid.uuid4().hex[:8]}",  # unique even if a client reuses ids
            kv_transfer_params=parsed.kv_transfer_params,
        )
        gen = await engine.generate(prompt)
    except Exception as exc:  # every failure is an OpenAI-style error answer
        engine.stats.requests_failed += 1
        return _error(exc, headers)
    reply = Reply.new(kind, model, gen.tokens, gen.prompt_tokens, gen.kv_transfer_params)
    if parsed.stream:
        return StreamingResponse(
            _aiter(reply.chunks(parsed.include_usage)),
            media_type="text/event-stream",
            headers=headers,
        )
    return JSONResponse(reply.body(), headers=headers)


def _check_request_id(rid: str) -> None:
    """The client's X-Request-Id becomes (suffixed) the request id of our holds: a 400 naming
    the header unless that fits a RequestId (the sidecar would refuse the hold otherwise)."""
    try:
        msgspec.convert(rid + _SUFFIX, RequestId)
    except msgspec.ValidationError:
        longest = REQUEST_ID_MAX_LENGTH - len(_SUFFIX)
        raise InvalidRequestError(
            "X-Request-Id",
            f"at most {longest} characters on one line: no control character but tab, no line "
            "separator",
        ) from None


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _error(exc: Exception, headers: dict[str, str]) -> Response:
    status = 502 if isinstance(exc, httpx.HTTPError) else status_of(exc)
    param = getattr(exc, "field", None) if isinstance(exc, InvalidRequestError) else None
    if status == 500:
        if isinstance(exc, KvxferdError):
            log.error("request failed: %s", exc)
        else:
            log.exception("request failed unexpectedly")
    message = str(exc) or type(exc).__name__
    if isinstance(exc, PullError):
        message = exc.detail or exc.reason
    elif isinstance(exc, httpx.HTTPError):
        message = f"sidecar unreachable: {message}"
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)
