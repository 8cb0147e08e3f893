"""The proxy's FastAPI app: prefill with 1 token, then decode with the returned transfer params.

Per request: pick a prefill and a decode (separate round-robin cycles), send the prefill a copy
of the body with ``max_tokens=1``, ``stream=false``, no ``n`` and the ``kv_transfer_params`` stub,
take the ``kv_transfer_params`` it answers with, and send the ORIGINAL body plus those params to
the decode, relaying its reply byte for byte (SSE when the client asked to stream; an event goes
on once whole). Both backends get the same ``X-Request-Id``. Nothing here depends on
kvxferd-only fields, so real vLLM works too.

Timeouts are per phase, so a healthy answer is never cut while bytes keep coming: connect, first
byte (the prefill's answer; a streaming decode's headers), idle (between chunks of any body) and,
for a non-streaming decode whose first byte is its whole answer, the generation bound.

When the decode call fails or is refused, the prefill is told (``POST /v1/kv/release`` with the
``kv_transfer_params`` it returned, best effort, in the background) so it frees the blocks it
holds for that decode now, not at lease expiry; a server without that route just answers 404,
and is not asked again for ``release_retry_s`` (a kvxferd prefill answers a request it does not
know with ``{"released": 0}``, never a 404, so a 404 means no route; it is asked again later
because the route may appear: a server still starting, or replaced at the same address).
So is it when the client goes away after the prefill answered but before a byte of the decode
request went out (the decode's connection still opening, or a kept one that failed its write
being replaced), or once the prefill may have the request but before its answer has all come
(a sim prefill finishes it anyway: its answer is awaited and read in the background, same
bounds, for the tickets it carries; vLLM, whose release is a 404, aborts a request whose caller
hangs up, so once a prefill answered a release 404 the proxy hangs up on it instead). Once the
decode may have the request it is left to the decode, which reads the hold or declines it: a
kvxferd prefill's release aborts the hold, which a decode that has not claimed it yet can then no
longer read. Releases in the background are capped (``BACKGROUND_CAP``); past that a hold is
left to its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from kvxferd.api.direct import DirectApp
from kvxferd.api.jsonbody import BodyError
from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S
from kvxferd.lanes import ssl_context
from kvxferd.proxy.bodies import (
    Body,
    batch_size,
    decode_body,
    encode,
    parse,
    prefill_body,
    release_body,
    streams,
    transfer_params,
)
from kvxferd.proxy.clients import SLOTS, ClientSlots
from kvxferd.proxy.failures import (
    BACKEND_ERRORS,
    AnswerTooLarge,
    BackendTimeout,
    bad_backend_reply,
    describe_failure,
    error_response,
    unreachable,
)
from kvxferd.proxy.relay import chunks as body_chunks
from kvxferd.proxy.relay import relay_events
from kvxferd.proxy.routing import Backend, RoundRobin
from kvxferd.proxy.transport import UNSENT, KeptBody, KeptTransport

log = logging.getLogger(__name__)

RELEASE_PATH = "/v1/kv/release"
"""Prefill route freeing the KV it holds for a decode that will not read it (kvxferd sim)."""
BACKGROUND_CAP = 1024
"""Most releases (each with the prefill answer it waits for) in the background at once. They
outlive the requests that started them, so the requests in flight do not bound them; past this
many (the front door's default connection cap) a hold is left to its lease."""
KEEPALIVE_PER_CLIENT = 16
"""Idle connections one backend client keeps (to prefills and decodes together; a client
serves one request at a time until the proxy has more in flight than clients)."""
_SSE = "text/event-stream"


@dataclass(frozen=True)
class ProxySettings:
    """Backend base URLs and the bounds of each phase of a backend call."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    timeout_s: float = 30.0
    """Default of ``connect_s``, ``first_byte_s`` and ``idle_s`` (the ``--timeout`` flag)."""
    connect_s: float | None = None
    """Bound on opening a connection to a backend (refused: at once)."""
    first_byte_s: float | None = None
    """Bound from sending a request to the first byte of its answer: the prefill's answer, a
    streaming decode's headers, /health and /v1/models."""
    idle_s: float | None = None
    """Bound on the silence between two chunks of an answer being relayed or read."""
    generation_s: float = 600.0
    """A non-streaming decode answers only once it has generated everything, so its first byte
    is its whole answer: this bound (at least ``first_byte``) replaces the first-byte one."""
    release_on_failure: bool = True
    """Tell the prefill (``POST /v1/kv/release``) when its decode call fails or is refused, or
    the client went away while the prefill call was in flight or before a byte of the decode
    request went out. Off, a gone client's prefill call is cancelled."""
    release_retry_s: float = 60.0
    """How long a prefill that answered a release 404 (no release route: vLLM) is not asked to
    release, and has a gone client's call ended instead; then the next release asks again."""
    max_answer_bytes: int = 256 << 20
    """Largest backend answer the proxy reads whole (a prefill's, a non-streaming decode's,
    /health, /v1/models); a larger one is a 502. Streamed (SSE) answers are relayed, not held."""

    @property
    def connect(self) -> float:
        """The connect bound in seconds."""
        return self.connect_s if self.connect_s is not None else self.timeout_s

    @property
    def first_byte(self) -> float:
        """The first-byte bound in seconds."""
        return self.first_byte_s if self.first_byte_s is not None else self.timeout_s

    @property
    def idle(self) -> float:
        """The idle (between chunks) bound in seconds."""
        return self.idle_s if self.idle_s is not None else self.timeout_s

    @property
    def generation(self) -> float:
        """The first-byte bound of a non-streaming decode."""
        return max(self.generation_s, self.first_byte)


def proxy_app(
    settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None
) -> DirectApp:
    """Build the app; ``transport`` replaces the network (e.g. an httpx.MockTransport)."""
    prefills = RoundRobin("prefill", settings.prefill)
    decodes = RoundRobin("decode", settings.decode)
    first_byte, idle, generation = settings.first_byte, settings.idle, settings.generation
    limit = settings.max_answer_bytes
    releases: set[asyncio.Task[None]] = set()
    # Prefills whose release route was a 404 (vLLM), each until when it is not asked; <= backends
    no_release: dict[str, float] = {}

    def releases_to(prefill: Backend) -> bool:
        """Whether ``prefill`` is told to release: on, and no 404 from it in the last
        ``release_retry_s``."""
        if not settings.release_on_failure:
            return False
        until = no_release.get(prefill.url)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del no_release[prefill.url]  # the route may be there now: the next release asks
        return True

    # Reads are bounded per phase below (first byte, idle); the transport bounds connect and
    # writes. Backend calls go straight to the transport: an httpx client would add a cookie
    # jar (one user's backend session sent with the next user's request), redirects and a
    # third of the proxy's CPU per request (issue 11).
    timeouts = {"connect": settings.connect, "write": idle}
    urls: dict[str, httpx.URL] = {}  # bounded: backends x the five paths the proxy calls

    def backend_request(
        method: str, url: str, body: Body | None = None, headers: dict[str, bytes] | None = None
    ) -> httpx.Request:
        """A request to a backend; ``body`` (if any) sent as JSON."""
        target = urls.get(url)
        if target is None:
            target = urls[url] = httpx.URL(url)
        out: dict[str, str | bytes] = dict(headers or {})
        content = None
        if body is not None:
            content = encode(body)
            out["Content-Type"] = "application/json"
        return httpx.Request(
            method, target, content=content, headers=out, extensions={"timeout": timeouts}
        )

    def in_background(work: Coroutine[Any, Any, None]) -> bool:
        """Run a release without the client's answer waiting for it (shutdown waits, bounded);
        False (``work`` dropped: the hold is left to its lease) past ``BACKGROUND_CAP``."""
        if len(releases) >= BACKGROUND_CAP:
            work.close()
            log.warning(
                "%d releases in the background: this one is left to the lease", BACKGROUND_CAP
            )
            return False
        task = asyncio.create_task(work)
        releases.add(task)
        task.add_done_callback(releases.discard)
        return True

    async def release(
        client: httpx.AsyncBaseTransport, prefill: Backend, params: msgspec.Raw,
        headers: dict[str, bytes],
    ) -> None:  # fmt: skip
        """Ask ``prefill`` to free what it holds under ``params``: no decode will read it."""
        ask = backend_request("POST", prefill.url + RELEASE_PATH, release_body(params), headers)
        if await _release(client, ask, prefill, first_byte, idle, limit) == 404:
            no_release[prefill.url] = time.monotonic() + settings.release_retry_s

    async def prefill_answer(
        client: httpx.AsyncBaseTransport, prefill: Backend, request: httpx.Request,
        headers: dict[str, bytes],
    ) -> tuple[httpx.Response, bytes]:  # fmt: skip
        """The prefill's answer, read whole. A prefill that has the request finishes it and holds
        KV named only in its answer, even if the client has gone meanwhile: then the call goes
        on in the background (within the same bounds) and what the answer names is released."""
        answer = asyncio.ensure_future(_call(client, request, first_byte, idle, limit))
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:  # the client has gone (_unless_gone)
            # UNSENT: its connection still opening, the prefill has nothing to hold. One without
            # the release route (vLLM) aborts a request whose caller hangs up: let it.
            keep = releases_to(prefill) and request.extensions.get(UNSENT) is not True
            if not (keep and in_background(release_when_read(client, prefill, answer, headers))):
                answer.cancel()
            raise

    async def release_when_read(
        client: httpx.AsyncBaseTransport, prefill: Backend,
        answer: asyncio.Future[tuple[httpx.Response, bytes]], headers: dict[str, bytes],
    ) -> None:  # fmt: skip
        """Release what a prefill's answer names once it has been read (nothing if it fails)."""
        try:
            resp, content = await answer
            params = transfer_params(content) if resp.status_code < 400 else None
        except (*BACKEND_ERRORS, BodyError):
            return
        if params is not None:
            await release(client, prefill, params, headers)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        def make() -> httpx.AsyncBaseTransport:
            return transport or KeptTransport(
                ssl_context(), KEEPALIVE_PER_CLIENT, HTTP_CLIENT_KEEPALIVE_S
            )

        slots: ClientSlots[httpx.AsyncBaseTransport] = ClientSlots(
            make, limit=1 if transport else SLOTS
        )
        app.state.clients = slots
        app.state.background = releases
        try:
            yield
            if releases:  # bounded: what is not done by then is dropped (holds left to lease)
                await asyncio.wait(releases, timeout=settings.connect + first_byte)
        finally:
            for client in slots.made():
                await client.aclose()

    app = DirectApp(title="kvxferd proxy", lifespan=lifespan)

    async def relay(request: Request, path: str, chat: bool) -> Response:
        await request.body()  # read (and kept) first: from here on _unless_gone owns receive
        slots: ClientSlots[httpx.AsyncBaseTransport] = request.app.state.clients
        client = slots.take()
        try:  # a stream still being relayed shares the client with the next request
            return await _unless_gone(request, forward(request, path, chat, client))
        finally:
            slots.give(client)

    async def forward(
        request: Request, path: str, chat: bool, client: httpx.AsyncBaseTransport
    ) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body = parse(await request.body())
        except BodyError as exc:
            return error_response(
                400, f"request body {exc}", "invalid_request_error", request_id=request_id
            )
        if not chat and (prompts := batch_size(body)) > 1:
            # A vLLM prefill would hold the KV of every prompt and answer one's params: the
            # other holds would wait out their lease.
            return error_response(
                400, f"prompt: a batch of {prompts} prompts; the P/D path takes one prompt per "
                "request", "invalid_request_error", param="prompt", request_id=request_id,
            )  # fmt: skip
        # Header values go on as the client's bytes (starlette decoded them as latin-1; httpx
        # would encode a str as ASCII and fail on any other byte).
        headers = {"X-Request-Id": request_id.encode("latin-1")}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth.encode("latin-1")

        prefill = prefills.next()
        try:
            p_resp, p_content = await prefill_answer(client, prefill, backend_request(
                "POST", prefill.url + path, prefill_body(body, chat), headers
            ), headers)  # fmt: skip
        except BACKEND_ERRORS as exc:
            log.warning("request %s: prefill %s failed: %s", request_id, prefill.url,
                        describe_failure(exc))  # fmt: skip
            return unreachable(prefill, exc, first_byte, request_id)
        if p_resp.status_code >= 400:
            return _passthrough(p_resp.status_code, p_content, p_resp.headers, request_id)
        try:
            params = transfer_params(p_content)
        except BodyError as exc:
            return bad_backend_reply(prefill, f"answered a body that {exc}", request_id)
        if params is None:
            return bad_backend_reply(
                prefill,
                "answered without kv_transfer_params (is its KV connector configured?)",
                request_id,
            )

        def release_hold() -> None:
            """The decode will not read what the prefill holds: tell the prefill (not one that
            answered a release 404 lately: it has no such route, its holds end on its own)."""
            if releases_to(prefill):
                in_background(release(client, prefill, params, headers))

        decode = decodes.next()
        d_req = backend_request("POST", decode.url + path, decode_body(body, params), headers)
        wait = first_byte if streams(body) else generation
        try:
            d_resp = await _send(client, d_req, wait)
        except BACKEND_ERRORS as exc:
            log.warning("request %s: decode %s failed: %s", request_id, decode.url,
                        describe_failure(exc))  # fmt: skip
            release_hold()
            return unreachable(decode, exc, wait, request_id)
        except asyncio.CancelledError:  # the client has gone (_unless_gone)
            if d_req.extensions.get(UNSENT) is True:  # no decode will claim what the prefill holds
                release_hold()
            raise
        media = _media_type(d_resp.headers)
        refused = d_resp.status_code >= 400
        if refused or not media.startswith(_SSE):
            if refused:  # its head says so: whatever its body does, or the client, meanwhile
                release_hold()
            try:
                content = await _read(d_resp, idle, limit)
            except BACKEND_ERRORS as exc:
                if not refused:
                    release_hold()
                return unreachable(decode, exc, idle, request_id)
            finally:
                await d_resp.aclose()
            return _passthrough(d_resp.status_code, content, d_resp.headers, request_id)
        return StreamingResponse(
            relay_events(d_resp, decode, request_id, idle),
            status_code=d_resp.status_code,
            media_type=media,
            headers={"X-Request-Id": request_id},
        )

    @app.post_direct("/v1/completions")  # the P/D path: no FastAPI stack (kvxferd.api.direct)
    async def completions(request: Request) -> Response:
        return await relay(request, "/v1/completions", chat=False)

    @app.post_direct("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The first decode's list (every decode serves the model) that answers 2xx, in the order
        given: all are asked at once, so a down or hung one costs one call's bounds, not each."""
        auth = request.headers.get("authorization")  # a vLLM with --api-key asks for it
        headers = {"Authorization": auth.encode("latin-1")} if auth else None
        slots: ClientSlots[httpx.AsyncBaseTransport] = request.app.state.clients
        client = slots.take()
        asks = [
            asyncio.ensure_future(_call(
                client, backend_request("GET", d.url + "/v1/models", headers=headers),
                first_byte, idle, limit,
            ))
            for d in decodes.backends
        ]  # fmt: skip
        answers: list[tuple[httpx.Response, bytes]] = []
        failures: list[str] = []
        try:
            for decode, ask in zip(decodes.backends, asks, strict=True):
                try:
                    resp, content = await ask
                except BACKEND_ERRORS as exc:
                    failures.append(f"{decode.url}: {describe_failure(exc)}")
                    continue
                if resp.status_code < 300:
                    return _passthrough(resp.status_code, content, resp.headers, None)
                answers.append((resp, content))
                failures.append(f"{decode.url}: HTTP {resp.status_code}")
        finally:
            for ask in asks:
                ask.cancel()
            if asks:  # their connections given back before the client is
                await asyncio.wait(asks)
            for ask in asks:  # a failure nobody awaited is not logged as never retrieved
                if not ask.cancelled():
                    ask.exception()
            slots.give(client)
        if answers:  # a decode's own refusal (e.g. 401) says more than a 502
            resp, content = answers[0]
            return _passthrough(resp.status_code, content, resp.headers, None)
        return error_response(
            502, "no decode backend answered /v1/models: " + "; ".join(failures), "bad_gateway"
        )

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        slots: ClientSlots[httpx.AsyncBaseTransport] = request.app.state.clients
        client = slots.take()
        everyone = [*prefills.backends, *decodes.backends]
        try:
            probes = [backend_request("GET", b.url + "/health") for b in everyone]
            verdicts = await asyncio.gather(
                *(_probe(client, p, first_byte, idle, limit) for p in probes)
            )
        finally:
            slots.give(client)
        report: dict[str, Any] = {"prefill": {}, "decode": {}}
        for backend, verdict in zip(everyone, verdicts, strict=True):
            report[backend.role][backend.url] = verdict
        up = {role: [u for u, v in report[role].items() if v == "ok"] for role in report}
        healthy = bool(up["prefill"]) and bool(up["decode"])
        report["status"] = "ok" if healthy else "unavailable"
        report["down"] = [b.url for b, v in zip(everyone, verdicts, strict=True) if v != "ok"]
        return JSONResponse(report, status_code=200 if healthy else 503)

    return app


async def _unless_gone(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """``work``'s response; cancelled (its backend connections closed, so a decode stops
    generating for nobody) once the client has gone. Call it after the whole body was read."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()  # a streamed answer's own disconnect watch reads receive from here on
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it: the client has gone
    return task.result()


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (its body already read: nothing else can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _call(
    client: httpx.AsyncBaseTransport, request: httpx.Request, first_byte: float, idle: float,
    limit: int,
) -> tuple[httpx.Response, bytes]:  # fmt: skip
    """Send ``request``: its answer's head within ``first_byte``, then its body (at most
    ``limit`` bytes) with at most ``idle`` seconds between chunks. The (closed) response and its
    decoded body."""
    resp = await _send(client, request, first_byte)
    return resp, await _read_all(resp, idle, limit)


async def _send(
    client: httpx.AsyncBaseTransport, request: httpx.Request, first_byte: float
) -> httpx.Response:
    """Send ``request`` and wait (at most ``first_byte`` s) for its answer's head; streamed."""
    try:
        async with asyncio.timeout(first_byte):
            resp = await client.handle_async_request(request)
    except TimeoutError:
        raise BackendTimeout("first byte", first_byte) from None
    resp.request = request
    return resp


async def _read(resp: httpx.Response, idle: float, limit: int) -> bytes:
    """The whole (decoded) body of a streamed response, at most ``idle`` s between chunks;
    AnswerTooLarge past ``limit`` bytes."""
    encoded = resp.headers.get("content-encoding", "identity") not in ("identity", "")
    if isinstance(resp.stream, KeptBody) and not encoded:  # nothing to decode: bytes as they came
        whole = resp.stream.arrived()  # None unless the whole body came with the head
        if whole is not None:
            if len(whole) > limit:
                raise AnswerTooLarge(limit)
            return whole
    chunks, size = [], 0
    async for chunk in body_chunks(resp, idle):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_all(resp: httpx.Response, idle: float, limit: int) -> bytes:
    """``_read``, then the response closed (whatever the outcome)."""
    try:
        return await _read(resp, idle, limit)
    finally:
        await resp.aclose()


async def _release(
    client: httpx.AsyncBaseTransport,
    request: httpx.Request,
    prefill: Backend,
    first_byte: float,
    idle: float,
    limit: int,
) -> int | None:
    """Ask the prefill to free what it holds for a decode that will not read it (best effort):
    the status it answered (None if it did not)."""
    try:
        resp, _ = await _call(client, request, first_byte, idle, limit)
    except BACKEND_ERRORS as exc:
        log.warning("prefill %s: release failed: %s", prefill.url, describe_failure(exc))
        return None
    if resp.status_code >= 400 and resp.status_code != 404:  # 404: no such route (vLLM)
        log.warning("prefill %s: release answered %d", prefill.url, resp.status_code)
    return resp.status_code


async def _probe(
    client: httpx.AsyncBaseTransport, request: httpx.Request, first_byte: float, idle: float,
    limit: int,
) -> str:  # fmt: skip
    """``"ok"`` when a backend's /health (``request``) answers 2xx within the bounds, else the
    reason."""
    try:
        resp, _ = await _call(client, request, first_byte, idle, limit)
    except BACKEND_ERRORS as exc:
        return describe_failure(exc)
    return "ok" if resp.status_code < 300 else f"HTTP {resp.status_code}"


def _passthrough(
    status: int, content: bytes, headers: httpx.Headers, request_id: str | None
) -> Response:
    """A backend's reply as is: status, body and content type."""
    out = {"X-Request-Id": request_id} if request_id else None
    return Response(content=content, status_code=status, media_type=_media_type(headers),
                    headers=out)  # fmt: skip


def _media_type(headers: httpx.Headers) -> str:
    """A backend answer's Content-Type as its bytes, JSON if it has none. httpx decodes header
    bytes as UTF-8 where they are, and a character past latin-1 ("€") could not be written
    back: the client got a 500 and a streamed decode answer was left open. Bytes read as
    latin-1 are written back as they came."""
    for name, value in headers.raw:
        if name.lower() == b"content-type":
            return value.decode("latin-1")
    return "application/json"
