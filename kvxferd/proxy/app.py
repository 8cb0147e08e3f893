"""The proxy's FastAPI app: prefill with 1 token, then decode with the returned transfer params.

Per request: pick a prefill and a decode (separate round-robin cycles), send the prefill a copy
of the body with ``max_tokens=1``, ``stream=false`` and the ``kv_transfer_params`` stub, take the
``kv_transfer_params`` it answers with, and send the ORIGINAL body plus those params to the
decode, relaying its reply byte for byte (SSE when the client asked to stream). Both backends get
the same ``X-Request-Id``. Nothing here depends on kvxferd-only fields, so real vLLM works too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S
from kvxferd.proxy.failures import bad_backend_reply, describe_failure, error_response, unreachable
from kvxferd.proxy.routing import Backend, RoundRobin

log = logging.getLogger(__name__)

KV_TRANSFER_STUB: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill is told: compute the prompt, keep the KV for a remote decode to read."""

_BACKEND_ERRORS = (httpx.HTTPError, TimeoutError)
_SSE = "text/event-stream"


@dataclass(frozen=True)
class ProxySettings:
    """Backend base URLs and the bound on every backend call."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    timeout_s: float = 30.0
    """Prefill: whole call. Decode: until its headers, then between chunks. /health, /v1/models."""


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill's copy of a request: one token, no streaming, the transfer stub."""
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = dict(KV_TRANSFER_STUB)
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def proxy_app(
    settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """Build the app; ``transport`` replaces the network in unit tests (httpx.MockTransport)."""
    prefills = RoundRobin("prefill", settings.prefill)
    decodes = RoundRobin("decode", settings.decode)
    timeout_s = settings.timeout_s

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=HTTP_CLIENT_KEEPALIVE_S,
        )
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport
        ) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvxferd proxy", lifespan=lifespan)

    async def relay(request: Request, path: str, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(
                400, "request body must be a JSON object", "invalid_request_error"
            )
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth
        client: httpx.AsyncClient = request.app.state.client

        prefill = prefills.next()
        try:
            async with asyncio.timeout(timeout_s):
                p_resp = await client.post(
                    prefill.url + path, json=prefill_body(body, chat), headers=headers
                )
        except _BACKEND_ERRORS as exc:
            log.warning("request %s: prefill %s failed: %s", request_id, prefill.url,
                        describe_failure(exc))  # fmt: skip
            return unreachable(prefill, exc, timeout_s)
        if p_resp.status_code >= 400:
            return _passthrough(p_resp.status_code, p_resp.content, p_resp.headers, request_id)
        try:
            params = p_resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            return bad_backend_reply(prefill, "answered a body that is not a JSON object")
        if not isinstance(params, dict):
            return bad_backend_reply(
                prefill, "answered without kv_transfer_params (is its KV connector configured?)"
            )

        decode = decodes.next()
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        d_req = client.build_request("POST", decode.url + path, json=d_body, headers=headers)
        try:
            async with asyncio.timeout(timeout_s):
                d_resp = await client.send(d_req, stream=True)
        except _BACKEND_ERRORS as exc:
            log.warning("request %s: decode %s failed: %s", request_id, decode.url,
                        describe_failure(exc))  # fmt: skip
            return unreachable(decode, exc, timeout_s)
        media = d_resp.headers.get("content-type", "application/json")
        if d_resp.status_code >= 400 or not media.startswith(_SSE):
            try:
                content = await d_resp.aread()
            except _BACKEND_ERRORS as exc:
                return unreachable(decode, exc, timeout_s)
            finally:
                await d_resp.aclose()
            return _passthrough(d_resp.status_code, content, d_resp.headers, request_id)
        return StreamingResponse(
            _stream(d_resp, decode, request_id),
            status_code=d_resp.status_code,
            media_type=media,
            headers={"X-Request-Id": request_id},
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        decode = decodes.backends[0]
        client: httpx.AsyncClient = request.app.state.client
        try:
            async with asyncio.timeout(timeout_s):
                resp = await client.get(decode.url + "/v1/models")
        except _BACKEND_ERRORS as exc:
            return unreachable(decode, exc, timeout_s)
        return _passthrough(resp.status_code, resp.content, resp.headers, None)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        client: httpx.AsyncClient = request.app.state.client
        everyone = [*prefills.backends, *decodes.backends]
        verdicts = await asyncio.gather(*(_probe(client, b, timeout_s) for b in everyone))
        report: dict[str, Any] = {"prefill": {}, "decode": {}}
        for backend, verdict in zip(everyone, verdicts, strict=True):
            report[backend.role][backend.url] = verdict
        up = {role: [u for u, v in report[role].items() if v == "ok"] for role in report}
        healthy = bool(up["prefill"]) and bool(up["decode"])
        report["status"] = "ok" if healthy else "unavailable"
        report["down"] = [b.url for b, v in zip(everyone, verdicts, strict=True) if v != "ok"]
        return JSONResponse(report, status_code=200 if healthy else 503)

    return app


async def _probe(client: httpx.AsyncClient, backend: Backend, timeout_s: float) -> str:
    """``"ok"`` when the backend's /health answers 2xx within the bound, else the reason."""
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.get(backend.url + "/health")
    except _BACKEND_ERRORS as exc:
        return describe_failure(exc)
    return "ok" if resp.status_code < 300 else f"HTTP {resp.status_code}"


async def _stream(resp: httpx.Response, decode: Backend, request_id: str) -> AsyncIterator[bytes]:
    """Relay the decode's SSE bytes as they come; a broken stream ends with an SSE error event."""
    try:
        async for chunk in resp.aiter_bytes():  # decoded if the decode compressed
            yield chunk
    except _BACKEND_ERRORS as exc:
        reason = describe_failure(exc)
        log.warning("request %s: decode %s stream broke: %s", request_id, decode.url, reason)
        message = f"decode backend {decode.url} stream broke: {reason}"
        event = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
        yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        await resp.aclose()


def _passthrough(
    status: int, content: bytes, headers: httpx.Headers, request_id: str | None
) -> Response:
    """A backend's reply as is: status, body and content type."""
    out = {"X-Request-Id": request_id} if request_id else None
    media = headers.get("content-type", "application/json")
    return Response(content=content, status_code=status, media_type=media, headers=out)
