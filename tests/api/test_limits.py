"""Limits at the edge of a real ``kvxferd serve``, on both HTTP parsers (httptools, h11): a
flood of the peer port leaves the engine socket answering; oversized heads and bodies, and bodies
or heads that never finish, are answered (or dropped) within their bound instead of pinning the
server; the peer API's listeners share one body budget; JSON nested 1,000 deep is a 4xx."""

from __future__ import annotations

import contextlib
import resource
import selectors
import socket
from collections.abc import Iterator

import msgspec
import pytest

from kvxferd.api import engine, peer
from kvxferd.api.limits import (
    EdgeLimits,
    LimitedH11Protocol,
    LimitedHttpToolsProtocol,
    limited_protocol,
)
from kvxferd.client import EngineClient
from kvxferd.wire import ErrorBody
from kvxferd.wire.frames import frame
from tests.api.conftest import signed
from tests.sidecar.harness import metric, start_sidecar, wait_until

LIMITS = {
    "KVXFERD_MAX_BODY_BYTES": "4096",
    "KVXFERD_MAX_HEADER_BYTES": "4096",
    "KVXFERD_BODY_TIMEOUT_S": "1",
    "KVXFERD_HEADER_TIMEOUT_S": "1",
}
BOUND_S = 30.0  # how long a test waits for an answer before calling it a hang


@pytest.fixture(scope="module", params=["httptools", "h11"])
def limited(request, tmp_path_factory) -> Iterator[tuple[str, int]]:
    """A sidecar with small size limits and 1 s read timeouts, on either HTTP parser: (engine
    socket, peer port)."""
    env = {**LIMITS, "KVXFERD_HTTP": request.param}
    sidecar = start_sidecar(str(tmp_path_factory.mktemp("limits")), "limits", env=env)
    try:
        yield sidecar.socket, int(sidecar.peer.rpartition(":")[2])
    finally:
        sidecar.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    return sock


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """Read until the server closes the connection (bounded); the status and the raw answer.
    A server that closes with our unread bytes still queued makes the kernel send a reset, which
    may come after its answer: once the answer began, a reset ends it like a close."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            if not data:
                raise
            break
        if not chunk:
            break
        data += chunk
    assert data.startswith(b"HTTP/1.1 "), data[:100]
    return int(data[9:12]), data


def _error(raw: bytes) -> ErrorBody:
    return msgspec.json.decode(raw.partition(b"\r\n\r\n")[2], type=ErrorBody)


def test_a_body_announced_above_the_limit_is_413_before_a_byte_of_it_is_sent(limited):
    _, port = limited
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")  # fmt: skip
        status, raw = _answer(sock)
    assert status == 413
    body = _error(raw)
    assert body.error == "PayloadTooLarge" and "limit of 4096" in body.detail


def test_a_chunked_body_is_cut_at_the_limit(limited):
    _, port = limited
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1024
        # 8 KiB of chunks in one write: the server reads them in one go, so it does not close
        # with our bytes unread (a close with unread bytes is a reset, which may beat its 413).
        with contextlib.suppress(OSError):  # the server may close while we still send
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) * 8)
        status, raw = _answer(sock)
    assert status == 413 and _error(raw).error == "PayloadTooLarge"


def test_a_body_that_stops_arriving_is_408_and_the_connection_dropped(limited):
    _, port = limited
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        status, raw = _answer(sock)  # the 1 s body timeout, not forever
    assert status == 408 and _error(raw).error == "RequestTimeout"


def test_a_request_head_that_never_completes_is_dropped(limited):
    _, port = limited
    with _connect(port) as idle, _connect(port) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert idle.recv(1) == b"" and slow.recv(1) == b""  # closed by the server


@pytest.mark.parametrize("pieces", [1, 64], ids=["at-once", "piecewise"])
def test_an_oversized_request_head_is_refused(limited, pieces):
    _, port = limited
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n"
    step = len(head) // pieces + 1
    with _connect(port) as sock:
        with contextlib.suppress(OSError):  # the server may close while we still send
            for i in range(0, len(head), step):
                sock.sendall(head[i : i + step])
        status, _ = _answer(sock)
    assert status in (400, 431)  # h11 while the head arrives (400), the edge once whole (431)


def test_a_head_still_arriving_past_the_limit_is_refused_before_it_ends(limited):
    _, port = limited
    with _connect(port) as sock:
        with contextlib.suppress(OSError):  # the server may close while we still send
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            for _ in range(16):  # 8 KiB of headers, never the blank line
                sock.sendall(b"X-Pad: " + b"a" * 505 + b"\r\n")
        status, _ = _answer(sock)
    assert status == 400  # answered at once: not held until the head timeout drops it


def test_a_kept_connection_s_next_head_is_bounded_too(limited):
    _, port = limited
    with _connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):
            chunk = sock.recv(65536)
            assert chunk, "closed after the first answer"
            first += chunk
        assert first.startswith(b"HTTP/1.1 200")
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            for _ in range(16):
                sock.sendall(b"X-Pad: " + b"a" * 505 + b"\r\n")
        status, _ = _answer(sock)
    assert status == 400


def test_each_listener_gets_the_parser_its_setting_names_with_its_own_limits():
    limits = EdgeLimits(max_connections=7, max_header_bytes=100, max_body_bytes=10,
                        header_timeout_s=2.0, body_timeout_s=1.0)  # fmt: skip
    fast = limited_protocol(limits, "peer")
    assert issubclass(fast, LimitedHttpToolsProtocol)  # httptools is a dependency
    assert (fast.max_connections, fast.max_header_bytes, fast.header_timeout_s) == (7, 100, 2.0)
    h11 = limited_protocol(EdgeLimits(**{**limits.__dict__, "http": "h11"}), "peer")
    assert issubclass(h11, LimitedH11Protocol) and h11.max_connections == 7


def test_requests_within_the_limits_are_served(limited):
    socket_path, port = limited
    with EngineClient(socket_path, timeout_s=BOUND_S) as client:
        client.healthz()
    with _connect(port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, raw = _answer(sock)
    assert status == 200 and raw.endswith(b'{"status":"ok"}')


def test_the_peer_port_and_its_frames_port_share_one_body_budget(tmp_path):
    """A stalled body on the peer port and a stalled frame on the framed peer port count in one
    budget, shown on /metrics (the engine API's is apart); a third body waits for room, and is
    served once one of them goes."""
    env = {"KVXFERD_MAX_BODY_BYTES": "4096", "KVXFERD_MAX_HEADER_BYTES": "4096",
           "KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "8192"}  # fmt: skip
    sidecar = start_sidecar(str(tmp_path), "budget", env=env)
    port = int(sidecar.peer.rpartition(":")[2])
    frames_host, _, frames_port = sidecar.peer_frames.rpartition(":")

    def held(api: str) -> float:
        return metric(sidecar.peer, "kvxferd_request_body_bytes", api=api)

    try:
        with (
            _connect(port) as body,
            _connect(port) as third,
            socket.create_connection((frames_host, int(frames_port)), timeout=BOUND_S) as framed,
        ):
            body.sendall(b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n{")
            framed.sendall(frame(b"x" * 4096)[:100])
            wait_until(lambda: held("peer") == 8192, BOUND_S, "both to take the peer budget")
            assert held("engine") == 0
            third.sendall(b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Content-Length: 2\r\n\r\n{}")  # fmt: skip
            framed.close()  # its 4096 bytes go back: the third body gets in
            status, _ = _answer(third)
            assert status == 401  # read and handed to the app: unsigned
        wait_until(lambda: held("peer") == 0, BOUND_S, "every byte given back")
    finally:
        sidecar.stop()


# ------------------------------------------------------------------------------ connection flood

FLOOD = 2000
PEER_CAP = 256


@contextlib.contextmanager
def _open_files_limit(soft: int) -> Iterator[None]:
    """Children started inside get ``soft`` as their open-file limit (we restore ours after)."""
    old_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (old_soft, hard))


def test_a_flood_of_idle_peer_connections_leaves_the_engine_socket_answering(tmp_path):
    """2,000 idle connections against a sidecar allowed 1,024 open files: without a cap the
    peer port would take every descriptor and the engine socket could accept nothing."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < FLOOD + 200:
        pytest.skip(f"needs {FLOOD + 200} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    env = {"KVXFERD_PEER_MAX_CONNECTIONS": str(PEER_CAP), "KVXFERD_HEADER_TIMEOUT_S": "600"}
    with _open_files_limit(1024):
        sidecar = start_sidecar(str(tmp_path), "flood", env=env)
    port = int(sidecar.peer.rpartition(":")[2])
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):  # a bounded loop on loopback
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=BOUND_S))
        closed = _closed_by_server(flood)
        wait_until(lambda: len(closed()) >= FLOOD - PEER_CAP, BOUND_S, "the peer cap")
        with EngineClient(sidecar.socket, timeout_s=BOUND_S) as client:
            client.healthz()  # the engine socket answers while the peer port is full
        assert len(closed()) <= FLOOD - PEER_CAP + 1  # the rest were kept (up to the cap)
    finally:
        for sock in flood:
            sock.close()
    with _connect(port) as sock:  # once the flood is gone, the peer port serves again
        wait_until(lambda: _healthz(port), BOUND_S, "the peer port to serve again")
    sidecar.stop()


def _closed_by_server(socks: list[socket.socket]):  # noqa: ANN202
    """A function returning the flood sockets the server has closed so far (EOF or reset)."""
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    closed: set[socket.socket] = set()

    def poll() -> set[socket.socket]:
        for key, _ in sel.select(timeout=0.1):
            sock = key.fileobj
            with contextlib.suppress(BlockingIOError):
                try:
                    data = sock.recv(1)  # type: ignore[union-attr]
                except ConnectionResetError:
                    data = b""
                if data == b"":
                    closed.add(sock)  # type: ignore[arg-type]
                    sel.unregister(sock)
        return closed

    return poll


def _healthz(port: int) -> bool:
    try:
        with _connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return _answer(sock)[0] == 200
    except (OSError, AssertionError):
        return False


# ------------------------------------------------------------------------------ nested JSON

NESTED = "[" * 1000 + "]" * 1000


def _bodies(op) -> list[str]:  # noqa: ANN001
    """The operation's body with JSON nested 1,000 deep as an unknown field and as each field."""
    fields = [f.encode_name for f in msgspec.structs.fields(op.request)]
    return [f'{{"x": {NESTED}}}', NESTED, *(f'{{"{name}": {NESTED}}}' for name in fields)]


@pytest.mark.parametrize(
    ("app", "op"),
    [("engine", op) for op in engine.OPERATIONS if op.request is not None]
    + [("peer", op) for op in peer.OPERATIONS if op.request is not None],
    ids=lambda v: v if isinstance(v, str) else v.path,
)
def test_json_nested_1000_deep_is_a_4xx_naming_the_problem(fake_engine, fake_peer, app, op):
    client = fake_engine if app == "engine" else fake_peer
    for body in _bodies(op):
        raw = body.encode()
        resp = client.post(op.path, content=raw, headers=signed("POST", op.path, raw))
        assert 400 <= resp.status_code < 500, (body[:40], resp.text[:300])
        error = msgspec.json.decode(resp.content, type=ErrorBody)
        if resp.status_code == 400:
            assert error.error == "DecodeError" and "nested too deeply" in error.detail
