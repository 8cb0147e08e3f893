"""Tiny fake OpenAI backends for the proxy's routing tests, served in-process by uvicorn.

The proxy's job is HTTP routing, so fakes stand in for the engines here: a fake prefill answers
one token plus ``kv_transfer_params`` naming itself; a fake decode answers text that names itself
and the params it was given, streamed as SSE when asked. Every request is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvxferd.lanes import ssl_context
from kvxferd.proxy.transport import KeptTransport


@dataclass
class Seen:
    """One request a fake received."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeBackend:
    """Behaviour knobs and the record of one fake server."""

    name: str
    role: str
    seen: list[Seen] = field(default_factory=list)
    fail_status: int | None = None
    """Answer every completion with this HTTP status and an OpenAI error body."""
    hang: threading.Event | None = None
    """Completions wait for this event (set it to release them), or until their caller hangs
    up (recorded in ``left``)."""
    left: list[str] = field(default_factory=list)
    """Paths of hanging or held completions, or of streams, whose caller closed the connection."""
    hold: threading.Event | None = None
    """Completions wait for this event, then answer as usual even if their caller has gone (an
    engine finishes a request whose caller left: uvicorn does not cancel it); a caller gone while
    they wait is recorded in ``left``."""
    answered: list[dict[str, Any]] = field(default_factory=list)
    """The ``kv_transfer_params`` a prefill answered, in order, read by anyone or not."""
    release_status: int = 200
    """The status ``/v1/kv/release`` answers (404: a server without the route, like vLLM)."""
    omit_params: bool = False
    """Prefill answers without kv_transfer_params (like an engine without a KV connector)."""
    healthy: bool = True
    delay_s: float = 0.0
    """Slow but alive: wait this long before a JSON answer, and between two SSE events."""
    stall: threading.Event | None = None
    """A stream stops after its first event until this event is set (a silent decode)."""
    stall_mid_event: bool = False
    """With ``stall``, the stream stops halfway through its second event instead."""
    set_cookie: str = ""
    """Every completion answer carries ``Set-Cookie: <this>`` (a backend behind a session-keeping
    gateway)."""
    raw_params: bytes = b""
    """Prefill answers these raw bytes as its ``kv_transfer_params`` value (JSON a Python
    encoder would never write: NaN, a lone surrogate, deep nesting)."""
    pad_bytes: int = 0
    """A JSON completion answer carries a ``pad`` field this many bytes long."""
    gzip: bool = False
    """A JSON completion answer goes gzip-compressed (``Content-Encoding: gzip``), asked or not."""
    cut_body: threading.Event | None = None
    """A completion answer (JSON, a refusal's too) goes out in two parts: its head and the body's
    first byte, then (once this event is set) the rest, a prefill's kv_transfer_params included."""
    content_type: bytes = b""
    """A completion answer (JSON or SSE) carries this Content-Type, as these bytes (a backend
    may send any byte but CR, LF and NUL there)."""

    def completion_text(self, body: dict[str, Any]) -> str:
        params = body.get("kv_transfer_params") or {}
        return f"{self.name} decoded from {params.get('remote_engine_id')}"


def fake_app(fake: FakeBackend) -> FastAPI:
    """The FastAPI app of one fake backend."""
    app = FastAPI()

    async def complete(request: Request, chat: bool) -> Response:
        body = await request.json()
        fake.seen.append(Seen(request.url.path, body, dict(request.headers)))
        if fake.hang is not None:
            while not fake.hang.is_set():
                if await request.is_disconnected():
                    fake.left.append(request.url.path)
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
        noticed = False
        while fake.hold is not None and not fake.hold.is_set():
            if not noticed and (noticed := await request.is_disconnected()):
                fake.left.append(request.url.path)
            await asyncio.sleep(0.01)
        if fake.fail_status is not None:
            error = {"message": f"{fake.name} refuses", "type": "BadRequestError", "code": 7}
            refused = JSONResponse({"error": error}, status_code=fake.fail_status)
            if fake.cut_body is not None:
                parts = _cut(refused.body, fake.cut_body)
                return StreamingResponse(parts, fake.fail_status, media_type=refused.media_type)
            return refused
        text = "p" if fake.role == "prefill" else fake.completion_text(body)
        if body.get("stream"):
            events = _sse(fake.name, text, chat, fake.delay_s, fake.stall, fake.stall_mid_event)
            events = _noting_a_hang_up(events, fake.left, request.url.path)
            streamed = StreamingResponse(events, media_type="text/event-stream")
            return _typed(streamed, fake.content_type)
        await asyncio.sleep(fake.delay_s)
        reply = _choice_body(fake.name, text, chat)
        if fake.role == "prefill" and not fake.omit_params:
            reply["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": fake.name,
                "remote_block_ids": [[1, 2, 3]],
                "remote_host": "127.0.0.1",
                "remote_port": 1234,
                "remote_request_id": request.headers.get("x-request-id"),
                "tp_size": 1,
            }
            fake.answered.append(reply["kv_transfer_params"])
        if fake.pad_bytes:
            reply["pad"] = "x" * fake.pad_bytes
        answer: Response = JSONResponse(reply)
        if fake.raw_params:
            reply.pop("kv_transfer_params", None)
            raw = json.dumps(reply).encode()[:-1] + b', "kv_transfer_params": ' + fake.raw_params
            answer = Response(raw + b"}", media_type="application/json")
        if fake.set_cookie:
            answer.headers["set-cookie"] = fake.set_cookie
        if fake.gzip:
            answer = Response(gzip.compress(answer.body), media_type="application/json",
                              headers={"content-encoding": "gzip"})  # fmt: skip
        if fake.cut_body is not None:
            return StreamingResponse(_cut(answer.body, fake.cut_body), media_type=answer.media_type)
        return _typed(answer, fake.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/kv/release")
    async def release(request: Request) -> Response:
        fake.seen.append(Seen(request.url.path, await request.json(), dict(request.headers)))
        return JSONResponse({"released": 1}, status_code=fake.release_status)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        fake.seen.append(Seen(request.url.path, {}, dict(request.headers)))
        return {"object": "list", "data": [{"id": fake.name, "object": "model", "created": 0,
                                            "owned_by": "fake"}]}  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if fake.healthy else 503)

    return app


def _typed(answer: Response, content_type: bytes) -> Response:
    """``answer`` with its Content-Type replaced by ``content_type`` (if any), byte for byte."""
    if content_type:
        answer.headers["content-type"] = content_type.decode("latin-1")  # starlette: latin-1
    return answer


def _choice_body(name: str, text: str, chat: bool) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "length", "logprobs": None}  # fmt: skip
        return {"id": "c-1", "object": "chat.completion", "created": 0, "model": name,
                "choices": [choice]}  # fmt: skip
    choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
    return {"id": "c-1", "object": "text_completion", "created": 0, "model": name,
            "choices": [choice]}  # fmt: skip


def sse_events(name: str, text: str, chat: bool) -> list[bytes]:
    """The exact SSE bytes a fake decode streams for ``text`` (one event per word)."""
    out = []
    for word in text.split(" "):
        if chat:
            choice = {"index": 0, "delta": {"content": word + " "}, "finish_reason": None}
            obj = {"id": "c-1", "object": "chat.completion.chunk", "created": 0, "model": name,
                   "choices": [choice]}  # fmt: skip
        else:
            choice = {"index": 0, "text": word + " ", "finish_reason": None, "logprobs": None}
            obj = {"id": "c-1", "object": "text_completion", "created": 0, "model": name,
                   "choices": [choice]}  # fmt: skip
        out.append(f"data: {json.dumps(obj)}\n\n".encode())
    out.append(b"data: [DONE]\n\n")
    return out


async def _cut(content: bytes, until: threading.Event) -> AsyncIterator[bytes]:
    yield content[:1]
    while not until.is_set():
        await asyncio.sleep(0.01)
    yield content[1:]


async def _noting_a_hang_up(
    events: AsyncIterator[bytes], left: list[str], path: str
) -> AsyncIterator[bytes]:
    """``events``; ``path`` noted in ``left`` if their caller hangs up before the last."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:  # uvicorn saw the connection close
        left.append(path)
        raise


async def _sse(
    name: str,
    text: str,
    chat: bool,
    gap_s: float = 0.0,
    stall: threading.Event | None = None,
    mid_event: bool = False,
) -> AsyncIterator[bytes]:
    for i, event in enumerate(sse_events(name, text, chat)):
        if i == 1 and stall is not None:
            if mid_event:
                half, event = event[: len(event) // 2], event[len(event) // 2 :]
                yield half
            while not stall.is_set():
                await asyncio.sleep(0.01)
        yield event
        await asyncio.sleep(gap_s)


@dataclass
class Served:
    """An ASGI app served by uvicorn on a loopback port in a background thread."""

    url: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), f"server {self.url} did not stop"


def serve_app(app: Any, port: int = 0, lifespan: str = "auto") -> Served:
    """Serve ``app`` on 127.0.0.1 (``port`` 0 = any free); waits (bounded) until it listens."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    return Served(f"http://127.0.0.1:{port}", port, server, thread)


def free_port() -> int:
    """A loopback port nobody listens on right now (connections to it are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnopenedDecode(KeptTransport):
    """The proxy's transport, except that a connection to ``port`` never opens once ``opens`` have
    (a decode whose accept queue is full, a lost SYN): ``connecting`` is set once one is being
    opened, and the attempt waits until it is cancelled (then ``abandoned`` is set). With
    ``break_kept`` a kept connection to ``port`` is handed out broken (reset while idle, unseen
    until written to: its write fails), counted in ``broken``."""

    def __init__(self, port: int, opens: int = 0, break_kept: bool = False) -> None:
        super().__init__(ssl_context())
        self.port = port
        self.opens = opens
        self.break_kept = break_kept
        self.broken = 0
        self.connecting = threading.Event()
        self.abandoned = threading.Event()

    def _take(self, origin: Any) -> Any:
        conn = super()._take(origin)
        if conn is not None and origin[2] == self.port and self.break_kept:
            fd = conn.writer.get_extra_info("socket").fileno()
            with socket.socket(fileno=os.dup(fd)) as sock:  # uvloop's own refuses shutdown()
                sock.shutdown(socket.SHUT_WR)
            self.broken += 1
        return conn

    async def _open(self, origin: Any, request: httpx.Request, timeout: float | None) -> Any:
        if origin[2] != self.port:
            return await super()._open(origin, request, timeout)
        if self.opens > 0:
            self.opens -= 1
            return await super()._open(origin, request, timeout)
        self.connecting.set()
        try:
            await asyncio.Future()  # never done: only a cancellation ends it
        except asyncio.CancelledError:
            self.abandoned.set()
            raise
        raise AssertionError("unreachable")


class HeadWatch(KeptTransport):
    """The proxy's transport, setting ``headed`` once an answer's head from ``port`` arrived. With
    ``hold`` that answer reaches the proxy only once ``hold`` is set: to the proxy, the backend
    has not answered yet (a real engine that cannot be told to wait)."""

    def __init__(self, port: int, hold: threading.Event | None = None) -> None:
        super().__init__(ssl_context())
        self.port = port
        self.hold = hold
        self.headed = threading.Event()

    async def _exchange(self, origin: Any, *args: Any) -> httpx.Response:
        resp = await super()._exchange(origin, *args)
        if origin[2] == self.port:
            self.headed.set()
            try:
                while self.hold is not None and not self.hold.is_set():
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                await resp.aclose()
                raise
        return resp


READY_TIMEOUT_S = 60.0


@contextlib.contextmanager
def proxy_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvxferd proxy ARGS`` in a child process, once it printed its ready line (bounded):
    (the process, its URL). Stopped (SIGTERM, then killed) and drained on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxferd", "proxy", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)  # type: ignore[union-attr]
    pump.start()
    try:
        line = lines.get(timeout=READY_TIMEOUT_S)
        assert line.startswith("kvxferd proxy ready url=http://127.0.0.1:"), line
        yield proc, line.split("url=", 1)[1].strip()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        pump.join(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
