"""The limited HTTP edge behaves the same on both parsers (h11 and httptools): keep-alive,
chunked bodies, refusals with an ErrorBody, a partial head bounded in size, a per-listener
connection cap, a body budget across connections (a body waits unread for room, else 503).
Served in-process by uvicorn on loopback; ``EdgeLimits.http`` picks the parser."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import uvicorn

from kvxferd.api.bodybudget import BodyBudget
from kvxferd.api.limits import BodyLimit, EdgeLimits, uvicorn_limits
from kvxferd.wire import ErrorBody

LIMITS = EdgeLimits(max_connections=4, max_header_bytes=512, max_body_bytes=1024,
                    header_timeout_s=30.0, body_timeout_s=30.0)  # fmt: skip
BOUND_S = 30.0


async def _echo(scope, receive, send) -> None:  # noqa: ANN001
    """Answers 200 with the request body."""
    if scope["type"] != "http":
        return
    body = (await receive())["body"]
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def _served(app, limits: EdgeLimits) -> Iterator[tuple[int, uvicorn.Server]]:  # noqa: ANN001
    """``app`` behind the limited edge, served by uvicorn in a thread: (port, server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(BodyLimit.of(app, limits), log_level="warning", access_log=False,
                            lifespan="off", **uvicorn_limits(limits, "test"))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + BOUND_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        thread.join(timeout=BOUND_S)


@pytest.fixture(scope="module", params=["h11", "httptools"])
def port(request) -> Iterator[int]:
    with _served(_echo, dataclasses.replace(LIMITS, http=request.param)) as (port, _server):
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One Content-Length-framed response: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a full head: {data[:100]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
               if line.lower().startswith(b"content-length:")]  # fmt: skip
    while len(body) < (lengths[0] if lengths else 1 << 30):  # no length: read to the close
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""  # a reset after the answer began ends it like a close
        if not chunk:
            assert not lengths, "closed mid-body"
            break
        body += chunk
    return int(head[9:12]), body


def test_two_requests_on_one_kept_alive_connection(port) -> None:
    with _connect(port) as sock:
        for body in (b"one", b"two"):
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n" + body)
            assert _read_response(sock) == (200, body)


def test_a_body_larger_than_the_head_limit_sent_after_its_head_is_not_counted_as_a_head(port):
    body = b"b" * 1000  # past max_header_bytes, within max_body_bytes
    with _connect(port) as sock:
        for _ in range(2):
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            sock.sendall(body)
            assert _read_response(sock) == (200, body)


def test_a_chunked_body_within_the_limit_reaches_the_app_whole(port) -> None:
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")  # fmt: skip
        assert _read_response(sock) == (200, b"abcde")


def test_an_announced_oversized_body_is_413_with_an_error_body(port) -> None:
    with _connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        status, body = _read_response(sock)
    assert status == 413
    assert msgspec.json.decode(body, type=ErrorBody).error == "PayloadTooLarge"


def test_a_head_growing_past_the_limit_in_pieces_is_400_and_closed(port) -> None:
    with _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(OSError):  # the server may close while we still send
            for _ in range(8):
                sock.sendall(b"X-Pad: " + b"a" * 200 + b"\r\n")
        status, _ = _read_response(sock)
        assert status == 400
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""


def test_connections_over_the_cap_are_closed_at_once(port) -> None:
    socks = [_connect(port) for _ in range(LIMITS.max_connections)]
    try:
        for sock in socks:  # each is served, so each is counted
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz")
            assert _read_response(sock) == (200, b"z")
        with _connect(port) as extra, contextlib.suppress(ConnectionResetError):
            assert extra.recv(1) == b""
    finally:
        for sock in socks:
            sock.close()


async def _large(scope, receive, send) -> None:  # noqa: ANN001
    """Answers 200 with 32 MiB: more than the socket buffers hold for a client that never
    reads."""
    if scope["type"] != "http":
        return
    await receive()
    body = b"k" * (32 << 20)
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_client_that_stops_reading_its_answer_is_disconnected(http) -> None:
    # Our writes stall once the socket buffers are full; without a bound on the stall the
    # connection (and its slot under the cap) would be held forever by anyone who can connect.
    from tests.sidecar.harness import wait_until

    limits = dataclasses.replace(LIMITS, body_timeout_s=0.3, http=http)
    with _served(_large, limits) as (port, server), _connect(port) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_until(lambda: len(server.server_state.connections) == 1, BOUND_S, "accepted")
        wait_until(lambda: not server.server_state.connections, BOUND_S, "the close")


# ------------------------------------------------------------------------------ body budget


def _budget(server: uvicorn.Server) -> BodyBudget:
    limit = server.config.app
    assert isinstance(limit, BodyLimit)
    return limit.budget


def _stall(port: int, announced: int, sent: bytes) -> socket.socket:
    """A connection whose request announces ``announced`` body bytes and sends ``sent``."""
    sock = _connect(port)
    sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (announced, sent))
    return sock


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_stalled_bodies_hold_what_they_announced_and_the_next_body_waits_for_room(http) -> None:
    # Two bodies that never finish fill a budget of two bodies; a third request waits unread
    # (not answered, not failed) and is served once one of them completes.
    from tests.sidecar.harness import wait_until

    limits = dataclasses.replace(LIMITS, max_body_bytes_in_flight=2048, http=http)
    with _served(_echo, limits) as (port, server):
        budget = _budget(server)
        with _stall(port, 1024, b"a" * 10) as first, _stall(port, 1024, b"b" * 10):
            wait_until(lambda: budget.taken == 2048, BOUND_S, "both bodies to take the budget")
            with _stall(port, 3, b"abc") as third:
                wait_until(lambda: budget.waiting == 1, BOUND_S, "the third body to wait")
                assert budget.taken == 2048  # the stalled ones hold what they announced
                third.setblocking(False)
                with pytest.raises(BlockingIOError):
                    third.recv(1)  # nothing answered while it waits
                third.setblocking(True)
                first.sendall(b"a" * 1014)
                assert _read_response(first) == (200, b"a" * 1024)
                assert _read_response(third) == (200, b"abc")
                assert budget.waiting == 0
        wait_until(lambda: budget.taken == 0, BOUND_S, "the closed stall to give its bytes back")


async def _slow(scope, receive, send) -> None:  # noqa: ANN001
    """Echoes the body, after ``_RELEASE`` is set when the body starts with b"hold"."""
    if scope["type"] != "http":
        return
    body = (await receive())["body"]
    while body.startswith(b"hold") and not _RELEASE.is_set():
        await asyncio.sleep(0.005)  # a poll of a cross-thread event, not synchronisation
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_RELEASE = threading.Event()


def test_a_body_that_finds_no_room_within_the_body_timeout_is_503_busy() -> None:
    from tests.sidecar.harness import wait_until

    _RELEASE.clear()
    limits = dataclasses.replace(LIMITS, max_body_bytes_in_flight=1024, body_timeout_s=0.5)
    with _served(_slow, limits) as (port, server):
        budget = _budget(server)
        body = b"hold" + b"h" * 1020
        with _stall(port, 1024, body) as holder:  # whole, and held while the app runs
            wait_until(lambda: budget.taken == 1024, BOUND_S, "the holder to take the budget")
            with _stall(port, 3, b"abc") as late:
                status, raw = _read_response(late)
            assert status == 503
            error = msgspec.json.decode(raw, type=ErrorBody)
            assert error.error == "Busy" and "at most 1024 bytes" in error.detail
            _RELEASE.set()
            assert _read_response(holder) == (200, body)
        wait_until(lambda: budget.taken == 0, BOUND_S, "the bytes to come back")
