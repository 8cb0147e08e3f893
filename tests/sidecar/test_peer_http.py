"""The peer API's HTTP/1.1 client against a real (tiny) asyncio server on loopback."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvxferd.sidecar.peer_http import MAX_BODY, MAX_HEAD, PeerConnection, PeerHTTPError


class _Server:
    """A listening server and its handlers' writers; ``stop`` closes all and waits."""

    def __init__(self, server: asyncio.Server, writers: list) -> None:
        self.server, self.writers = server, writers

    def close(self) -> None:
        self.server.close()
        for w in self.writers:
            w.close()

    async def stop(self) -> None:
        self.close()
        await self.server.wait_closed()
        for w in self.writers:
            with contextlib.suppress(OSError):
                await w.wait_closed()


def _length(head: bytes) -> int:
    """A request head's Content-Length."""
    return next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length"))  # fmt: skip


async def _serve(answer, close_after: bool = False):  # noqa: ANN001
    """A server answering each request with ``answer(body) -> bytes``; (server, address, seen)."""
    seen: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(_length(head))
                seen.append(head + body)
                writer.write(answer(body))
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return _Server(server, writers), f"127.0.0.1:{port}", seen


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body), body)  # fmt: skip


def _conn(address: str, **kw: float) -> PeerConnection:
    return PeerConnection(address, timeout_s=kw.get("timeout_s", 5.0), keepalive_s=4.0, limit=4)


def test_calls_reuse_one_kept_connection_and_send_the_headers():
    async def scenario() -> None:
        server, address, seen = await _serve(_ok)
        conn = _conn(address)
        for i in range(3):
            reply = await conn.post("/v1/claims", b'{"n":%d}' % i, {"Authorization": "KVX1 x"})
            assert (reply.status_code, reply.content) == (200, b'{"n":%d}' % i)
        assert conn.opened == 1
        assert seen[0].startswith(b"POST /v1/claims HTTP/1.1\r\n")
        assert b"Authorization: KVX1 x\r\n" in seen[0] and b"Content-Length: 7\r\n" in seen[0]
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


def test_a_connection_the_peer_closed_while_idle_is_replaced_not_an_error():
    async def scenario() -> None:
        server, address, seen = await _serve(_ok, close_after=True)
        conn = _conn(address)
        assert (await conn.post("/a", b"1", {})).content == b"1"
        await asyncio.sleep(0.05)  # the server's close reaches us (or not: both must work)
        assert (await conn.post("/a", b"2", {})).content == b"2"
        assert conn.opened == 2 and len(seen) == 2  # each request reached the server once
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n", b"x"),
        (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{}", b"{}"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x=1\r\nab\r\n1\r\nc\r\n"
            b"0\r\nx-trailer: 1\r\n\r\n",
            b"abc",
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"ok"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nContent-Length: 2\r\n\r\nok", b"ok"),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", b"ok"),
    ],
    ids=[
        "chunked",
        "until-close",
        "chunked-ext-trailers",
        "informational",
        "same-lengths",
        "http10",
    ],
)
def test_other_valid_framings_are_read_and_not_kept_when_closed(answer, body):
    async def scenario() -> None:
        server, address, _ = await _serve(lambda _b: answer, close_after=True)
        conn = _conn(address)
        assert (await conn.post("/a", b"{}", {})).content == body
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nx: " + b"a" * 2 * MAX_HEAD + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY + 1),
        # more digits than Python converts to an int (4,300): a ValueError escaped the client
        b"HTTP/1.1 200 OK\r\ncontent-length: " + b"9" * 5000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: a\r\n folded\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n",
    ],
    ids=[
        "not-http",
        "truncated",
        "huge-head",
        "huge-body",
        "length-of-5000-digits",
        "two-lengths",
        "negative-length",
        "folded-header",
        "unknown-coding",
        "coding-and-length",
        "bad-chunk-size",
        "truncated-chunk",
        "bad-status",
    ],
)
def test_answers_it_cannot_read_are_errors_and_drop_the_connection(answer):
    async def scenario() -> None:
        server, address, _ = await _serve(lambda _b: answer, close_after=True)
        conn = _conn(address)
        with pytest.raises(PeerHTTPError):
            await conn.post("/a", b"{}", {})
        assert conn._idle == []  # noqa: SLF001 - nothing kept after a bad answer
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


def test_a_peer_that_never_answers_times_out_and_an_error_status_is_a_reply():
    async def scenario() -> None:
        server, address, _ = await _serve(lambda _b: b"")  # reads, never answers
        with pytest.raises(TimeoutError):
            await _conn(address, timeout_s=0.2).post("/a", b"{}", {})
        await server.stop()
        server, address, _ = await _serve(
            lambda _b: b"HTTP/1.1 410 Gone\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
        )
        conn = _conn(address)
        reply = await conn.post("/a", b"{}", {})
        assert (reply.status_code, reply.text) == (410, "{}")
        assert conn._idle == []  # noqa: SLF001 - "connection: close" is honoured
        await server.stop()

    asyncio.run(scenario())


def test_a_request_field_that_would_break_the_framing_is_refused_before_any_write():
    async def scenario() -> None:
        server, address, seen = await _serve(_ok)
        conn = _conn(address)
        with pytest.raises(PeerHTTPError):
            await conn.post("/a", b"{}", {"Authorization": "x\r\nX-Injected: 1"})
        with pytest.raises(PeerHTTPError):
            await conn.post("/a b", b"{}", {})
        assert conn.opened == 0 and seen == []
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


def test_an_unreachable_peer_is_an_os_error():
    async def scenario() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(OSError):
            await _conn(f"127.0.0.1:{port}").post("/a", b"{}", {})

    asyncio.run(scenario())


def test_a_late_answer_to_a_call_that_timed_out_is_never_read_as_the_next_calls_answer():
    # A benign slow peer: the first call times out, the peer answers it later. Its connection
    # was dropped with the call, so the next call (another hold, maybe) reads only its own.
    async def scenario() -> None:
        slow: list[asyncio.StreamWriter] = []
        writers: list[asyncio.StreamWriter] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    body = await reader.readexactly(_length(head))
                    if body == b"slow":
                        slow.append(writer)  # answered only once the next request came
                        continue
                    for late in slow:  # the late answer goes out first, on its connection
                        late.write(_ok(b"slow"))
                    writer.write(_ok(body))
                    await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        conn = _conn(address, timeout_s=0.3)
        with pytest.raises(TimeoutError):
            await conn.post("/a", b"slow", {})
        assert (await conn.post("/a", b"2", {})).content == b"2"
        assert conn.opened == 2 and len(slow) == 1  # the slow call's connection was not kept
        await conn.aclose()
        await _Server(server, writers).stop()

    asyncio.run(scenario())


def test_an_answer_no_request_asked_for_is_never_read_as_the_next_calls_answer():
    # A peer that sends an extra answer after the one asked for: on a kept connection the next
    # call (maybe another hold's claim) would take it as its own. The connection is dropped.
    async def scenario() -> None:
        answers = iter([_ok(b"1") + _ok(b"stray")])
        server, address, seen = await _serve(lambda body: next(answers, None) or _ok(body))
        conn = _conn(address)
        assert (await conn.post("/a", b"1", {})).content == b"1"
        assert (await conn.post("/a", b"2", {})).content == b"2"
        assert conn.opened == 2 and len(seen) == 2
        await conn.aclose()
        await server.stop()

    asyncio.run(scenario())


def test_a_retry_after_a_kept_connection_closed_unanswered_is_signed_anew_not_a_replay():
    # The peer read the request (and recorded its signature's nonce), then closed the kept
    # connection without answering. The one retry goes on a new connection: signed again, with
    # a fresh nonce, it is accepted; the same signature again was refused as a replay (401).
    from kvxferd.errors import AuthError
    from kvxferd.sidecar.signing import PeerKeys, RequestVerifier, parse_header, sign_request

    keys = PeerKeys.of("retry-secret")
    verifier = RequestVerifier(keys)
    nonces: list[str] = []
    drop = [True]  # the first request of the second call: read, verified, closed unanswered

    def auth(head: bytes) -> str:
        line = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"authorization:"))
        return line.partition(b":")[2].strip().decode()

    async def scenario() -> None:
        writers: list[asyncio.StreamWriter] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    body = await reader.readexactly(_length(head))
                    nonces.append(parse_header(auth(head))["nonce"])
                    try:
                        verifier.verify("POST", "/v1/heartbeat", body, auth(head))
                    except AuthError as exc:
                        writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s"
                                     % (len(str(exc)), str(exc).encode()))  # fmt: skip
                        continue
                    if body == b"2" and drop[0]:
                        drop[0] = False
                        break
                    writer.write(_ok(body))
                    await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        conn = _conn(address)
        for body in (b"1", b"2"):

            def sign(body: bytes = body) -> dict[str, str]:
                return {"Authorization": sign_request(keys, "POST", "/v1/heartbeat", body)}

            reply = await conn.post("/v1/heartbeat", body, {}, sign)
            assert (reply.status_code, reply.text) == (200, body.decode())
        assert not drop[0] and conn.opened == 2  # the second call's kept connection was dropped
        assert len(nonces) == 3 and len(set(nonces)) == 3  # its retry carried a fresh nonce
        await conn.aclose()
        await _Server(server, writers).stop()

    asyncio.run(scenario())
