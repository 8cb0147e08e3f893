"""Test helpers of the framed engine API: raw frames over a blocking Unix socket, the same call
over HTTP/msgpack for comparison, and a FrameServer run in-process on a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec

from kvxferd.api.engine import OPERATIONS
from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.operations import Gate, Operation
from kvxferd.api.sockets import bind_unix
from kvxferd.wire import FrameAnswer, FrameRequest
from kvxferd.wire.frames import NIL, frame, frame_length

MSGPACK_HEADERS = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
BOUND_S = 20.0
"""Bound of every blocking read in these tests (a hang fails instead of stalling the run)."""


def connect(path: str) -> socket.socket:
    """A blocking connection to a frames socket whose reads are bounded by BOUND_S."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(BOUND_S)
    sock.connect(path)
    return sock


def request_bytes(call_id: int, op: str, body: Any = None, query: dict | None = None) -> bytes:
    """One framed request; ``body`` is encoded as msgpack (None: no body)."""
    raw = NIL if body is None else msgspec.Raw(msgspec.msgpack.encode(body))
    return frame(msgspec.msgpack.encode(FrameRequest(id=call_id, op=op, query=query or {},
                                                     body=raw)))  # fmt: skip


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer if the server closed the connection first."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def read_answer(sock: socket.socket) -> FrameAnswer:
    """The next answer frame (AssertionError if the connection closed instead)."""
    header = recv_exact(sock, 4)
    assert len(header) == 4, "the server closed the connection"
    payload = recv_exact(sock, frame_length(header))
    return msgspec.msgpack.decode(payload, type=FrameAnswer)


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) without answering, within BOUND_S."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def call(path: str, op: str, body: Any = None, query: dict | None = None) -> tuple[int, Any]:
    """One call over frames on a new connection: the status and the decoded body (builtins)."""
    with connect(path) as sock:
        sock.sendall(request_bytes(1, op, body, query))
        answer = read_answer(sock)
    assert answer.id == 1
    return answer.status, msgspec.msgpack.decode(answer.body)


def http_call(socket_path: str, op: str, body: Any = None, query: dict | None = None
              ) -> tuple[int, Any]:  # fmt: skip
    """The same call over HTTP with msgpack both ways."""
    method, path = op.split(" ", 1)
    content = None if body is None else msgspec.msgpack.encode(body)
    transport = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=transport, base_url="http://kvxferd", timeout=BOUND_S) as client:
        resp = client.request(method, path, content=content, params=query,
                              headers=MSGPACK_HEADERS)  # fmt: skip
    return resp.status_code, msgspec.msgpack.decode(resp.content) if resp.content else None


@contextmanager
def served(
    path: str, target: object, limits: FrameLimits, ready: bool = True, *,
    operations: list[Operation] = OPERATIONS, gate: Gate | None = None,
    sock: socket.socket | None = None,
) -> Iterator[FrameServer]:  # fmt: skip
    """The engine route table (or ``operations``) on ``target`` served as frames at ``path`` (or
    on the bound ``sock``, e.g. TCP) by a loop on its own thread, until the block ends."""
    loop = asyncio.new_event_loop()
    server = FrameServer(operations, target, gate or Gate(ready=lambda: ready), limits)
    sock = sock or bind_unix(path)
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start(sock))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(BOUND_S)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(grace_s=1.0), loop).result(BOUND_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(BOUND_S)
        loop.close()
        sock.close()
