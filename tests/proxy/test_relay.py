"""The proxy's SSE relay (kvxferd.proxy.relay): a decode's events go on to the client as each is
whole, and a stream that ends inside an event ends with the proxy's error event instead, whatever
frames the body: chunked, or (no Content-Length, not chunked) the decode closing its connection.

The decode here is a raw HTTP/1.1 server on loopback (uvicorn always frames a stream as chunked),
the prefill a fake (tests.proxy.fakes), the proxy the real app between them.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvxferd.proxy import ProxySettings, proxy_app
from kvxferd.proxy.relay import events_end
from tests.proxy.fakes import FakeBackend, fake_app, serve_app, sse_events
from tests.proxy.rig import CLIENT_TIMEOUT_S, completion

EVENTS = sse_events("D0", "one two", chat=False)
CLOSE_DELIMITED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
"""A streamed answer's head without a length or chunked framing: its body ends at the close."""


class RawDecode:
    """A decode that answers each request with ``answer`` as given, then closes."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.settimeout(30)
                _read_request(conn)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes its accept (a close alone does not)
        self.listener.close()
        self.thread.join(30)


def _read_request(conn: socket.socket) -> bytes:
    """One request, head and Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    while len(body) < length:
        body += conn.recv(65536)
    return head


@pytest.fixture
def proxy_to() -> Iterator:
    """``proxy_to(answer)``: a proxy whose decode answers ``answer`` raw; its URL and the
    decode's."""
    started: list = []

    def make(answer: bytes) -> tuple[str, str]:
        decode = RawDecode(answer)
        prefill = serve_app(fake_app(FakeBackend("P0", "prefill")))
        started.extend([decode, prefill])
        proxy = serve_app(proxy_app(ProxySettings((prefill.url,), (decode.url,), 10.0)))
        started.append(proxy)
        return proxy.url, decode.url

    yield make
    for served in reversed(started):
        if hasattr(served, "server"):
            served.server.should_exit = True
        served.close() if isinstance(served, RawDecode) else served.stop()


def _post(url: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        return c.post("/v1/completions", json=completion(stream=True))


def test_a_close_delimited_stream_cut_mid_event_ends_with_the_error_event(proxy_to) -> None:
    """The decode closed inside its second event: without a length, the close is the body's
    end, but a stream ends where an event does; the cut event is not relayed."""
    url, decode = proxy_to(CLOSE_DELIMITED + EVENTS[0] + EVENTS[1][:20])
    resp = _post(url)
    assert resp.status_code == 200  # the head had gone out
    assert resp.content.startswith(EVENTS[0]) and resp.content.endswith(b"\n\n")
    events = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e]
    assert len(events) == 2
    assert events[0] == json.loads(EVENTS[0].removeprefix(b"data: "))
    message = events[1]["error"]["message"]
    assert decode in message and "ended inside an event" in message


def test_a_close_delimited_stream_that_ends_with_an_event_is_relayed_whole(proxy_to) -> None:
    url, _ = proxy_to(CLOSE_DELIMITED + b"".join(EVENTS))
    resp = _post(url)
    assert resp.status_code == 200 and resp.content == b"".join(EVENTS)


@pytest.mark.parametrize(
    ("data", "end"),
    [(b"data: 1\n\ndata: 2", 9), (b"data: 1\r\n\r\ndata: 2\r\n", 11), (b"data: 1\r\rda", 9),
     (b"data: 1\r\n", 0), (b"", 0), (b"a\n\nb\n\nc", 6)],
)  # fmt: skip
def test_an_sse_event_ends_at_a_blank_line_of_any_line_end(data: bytes, end: int) -> None:
    assert events_end(data) == end
