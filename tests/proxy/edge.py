"""Raw-socket probes of an OpenAI-compatible listener's edge limits (``kvxferd proxy`` and
``kvxferd sim`` share them): each sends what a hostile or broken client would and asserts the
server answers or closes within a bound instead of waiting forever or crashing."""

from __future__ import annotations

import contextlib
import json
import socket

import httpx

from tests.sidecar.harness import wait_until

BOUND_S = 20.0
"""How long a probe waits for an answer or a close before calling it a hang; far above the body
timeout the servers under test get (1 s) and below their head timeout (60 s)."""
TEST_LIMITS = ["--max-connections", "4", "--max-body-bytes", "65536", "--body-timeout", "1",
               "--header-timeout", "60"]  # fmt: skip
"""Flags of the servers under test: a small cap and body limit, a short body timeout, and a head
timeout long enough that an idle connection is only ever closed by the cap."""
CAP = 4


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)


def answer(sock: socket.socket) -> tuple[int | None, bytes]:
    """Read until the server closes (bounded by the socket timeout): (status or None, raw)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    if not data:
        return None, data
    return int(data[9:12]), data


def error_of(raw: bytes) -> dict:
    """The OpenAI error object of an answer."""
    return json.loads(raw.partition(b"\r\n\r\n")[2])["error"]


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()  # fmt: skip


def check_stalled_body(port: int, path: str) -> None:
    """A body announced at 1 KB that stops after one byte: 408 (or closed) after the body
    timeout, never a wait for the rest."""
    with connect(port) as sock:
        sock.sendall(head(path, 1000) + b"{")
        status, raw = answer(sock)  # socket.timeout here is the hang
    assert status in (408, None), raw[:200]
    if status == 408:
        assert error_of(raw)["type"] == "RequestTimeout"


def check_oversized_announced(port: int, path: str) -> None:
    """A Content-Length above the limit is a 413 before a byte of the body is sent."""
    with connect(port) as sock:
        sock.sendall(head(path, 10**9))
        status, raw = answer(sock)
    assert status == 413, raw[:200]
    error = error_of(raw)
    assert error["type"] == "PayloadTooLarge" and "limit of 65536" in error["message"]


def check_flood(port: int, url: str) -> None:
    """With the cap's worth of idle connections open, one more is closed at once (not after the
    60 s head timeout); once they go, a fresh request is answered."""
    held = [connect(port) for _ in range(CAP)]
    try:
        with connect(port) as extra:
            status, raw = answer(extra)
        assert status is None and raw == b"", raw[:200]
    finally:
        for sock in held:
            sock.close()

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=BOUND_S).status_code == 200
        except httpx.TransportError:  # the server has not yet seen the held ones close
            return False

    wait_until(healthy, BOUND_S, "a fresh request answered after the flood")


def check_nested(url: str, path: str, depth: int) -> None:
    """JSON nested ``depth`` deep is a 4xx naming the body, never a 500."""
    body = b'{"prompt":' + b"[" * depth + b"]" * depth + b"}"
    resp = httpx.post(url + path, content=body, timeout=BOUND_S,
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert 400 <= resp.status_code < 500, resp.text[:200]
    assert "error" in resp.json()
