"""KeptTransport: the proxy's HTTP/1.1 under httpx, against real servers on loopback.

A request goes out in one write and its answer streams back; a connection whose answer was
read to the end is kept and reused, one abandoned mid-answer is closed, a kept connection the
server closed while idle is replaced without the caller seeing it, a POST is never sent twice, and
failures are httpx's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvxferd.proxy.transport import MAX_HEAD, UNSENT, KeptBody, KeptTransport
from tests.proxy.fakes import free_port, serve_app

GATE = threading.Event()
"""Holds back the last part of /gated until a test sets it."""


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        client = request.client
        return {"body": (await request.body()).decode(), "port": client.port if client else 0,
                "id": request.headers.get("x-request-id")}  # fmt: skip

    @app.get("/gated")
    async def gated() -> StreamingResponse:
        async def parts():
            yield b"first part;"
            await asyncio.to_thread(GATE.wait, 30)
            yield b"last part"

        return StreamingResponse(parts(), media_type="text/plain")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def parts():
            for i in range(50):
                yield f"part {i}\n".encode() * 100

        return StreamingResponse(parts(), media_type="text/plain")

    return app


@pytest.fixture(scope="module")
def server():
    served = serve_app(_app())
    yield served.url
    served.stop()


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=KeptTransport(ssl.create_default_context()), timeout=30)


def test_answers_arrive_whole_and_a_connection_read_to_the_end_is_reused(server):
    async def main() -> list[dict]:
        async with _client() as c:
            out = []
            for i in range(3):
                resp = await c.post(f"{server}/echo", content=f"body {i}",
                                    headers={"X-Request-Id": f"r{i}"})  # fmt: skip
                out.append(resp.json())
            return out

    got = asyncio.run(main())
    assert [g["body"] for g in got] == ["body 0", "body 1", "body 2"]
    assert [g["id"] for g in got] == ["r0", "r1", "r2"]
    assert len({g["port"] for g in got}) == 1  # one kept connection


def test_a_streamed_answer_comes_in_order_and_an_abandoned_one_is_not_reused(server):
    async def main() -> tuple[bytes, set[int]]:
        async with _client() as c:
            async with c.stream("GET", f"{server}/stream") as resp:
                whole = b"".join([chunk async for chunk in resp.aiter_bytes()])
            async with c.stream("GET", f"{server}/stream") as resp:
                await anext(resp.aiter_bytes())  # walk away mid-answer
            ports = {(await c.post(f"{server}/echo", content="x")).json()["port"]
                     for _ in range(2)}  # fmt: skip
            return whole, ports

    whole, ports = asyncio.run(main())
    assert whole == b"".join(f"part {i}\n".encode() * 100 for i in range(50))
    assert len(ports) == 1


def test_a_body_that_came_with_its_head_is_taken_whole_and_its_connection_kept(server):
    """KeptBody.arrived: the proxy's shortcut past httpx's readers for a small answer."""

    async def main() -> tuple[list[bytes | None], set[int]]:
        transport = KeptTransport(ssl.create_default_context())
        got, ports = [], set()
        try:
            for i in range(2):
                req = httpx.Request("POST", f"{server}/echo", content=f"body {i}")
                resp = await transport.handle_async_request(req)
                assert isinstance(resp.stream, KeptBody)
                whole = resp.stream.arrived()
                got.append(whole)
                assert resp.stream.arrived() is None  # taken once
                await resp.aclose()
                ports.add(json.loads(whole or b"{}").get("port"))
        finally:
            await transport.aclose()
        return got, ports

    got, ports = asyncio.run(main())
    assert [json.loads(g or b"{}")["body"] for g in got] == ["body 0", "body 1"]
    assert len(ports) == 1  # the connection went back to the pool and was reused


def test_a_body_still_arriving_is_not_taken_whole_but_read_as_it_comes(server):
    async def main() -> tuple[bytes | None, bytes]:
        transport = KeptTransport(ssl.create_default_context())
        GATE.clear()
        try:
            resp = await transport.handle_async_request(httpx.Request("GET", f"{server}/gated"))
            early = resp.stream.arrived()  # its last part is held back: not all here
            GATE.set()
            body = b"".join([chunk async for chunk in resp.aiter_raw()])
            await resp.aclose()
        finally:
            GATE.set()
            await transport.aclose()
        return early, body

    early, body = asyncio.run(main())
    assert early is None
    assert body == b"first part;last part"


def test_a_kept_connection_closed_by_the_server_is_replaced_unseen():
    answers = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answers[0] += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive was not refused, yet the connection goes away

    async def main() -> list[int]:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            async with _client() as c:
                codes = []
                for _ in range(3):
                    codes.append((await c.get(f"http://127.0.0.1:{port}/")).status_code)
                return codes
        finally:
            srv.close()

    assert asyncio.run(main()) == [200, 200, 200] and answers[0] == 3


def test_a_request_is_marked_unsent_until_its_bytes_may_have_gone_out(server):
    """The proxy releases a prefill's hold when the client leaves only while its decode request
    is unsent (no decode can claim the hold then)."""
    refused = httpx.Request("POST", f"http://127.0.0.1:{free_port()}/echo", content=b"x")
    answered = httpx.Request("POST", f"{server}/echo", content=b"x")

    async def main() -> None:
        transport = KeptTransport(ssl.create_default_context())
        try:
            with pytest.raises(httpx.ConnectError):
                await transport.handle_async_request(refused)
            resp = await transport.handle_async_request(answered)
            await resp.aclose()
        finally:
            await transport.aclose()

    asyncio.run(main())
    assert refused.extensions[UNSENT] is True
    assert answered.extensions[UNSENT] is False


def test_a_refused_connection_is_an_httpx_connect_error():
    async def main() -> None:
        async with _client() as c:
            await c.get(f"http://127.0.0.1:{free_port()}/")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(main())


def test_an_answer_that_is_not_http_is_an_httpx_protocol_error():
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-nonsense\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            async with _client() as c:
                await c.get(f"http://127.0.0.1:{port}/")
        finally:
            srv.close()

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(main())


def _raw_server_run(answer: bytes, requests: int = 1, close: bool = True):
    """Run ``requests`` GETs against a raw server that writes ``answer`` to each request; the
    (status, body) of each, and the connections the server saw."""
    seen = {"conns": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen["conns"] += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> list[tuple[int, bytes]]:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            async with _client() as c:
                out = []
                for _ in range(requests):
                    resp = await c.get(f"http://127.0.0.1:{port}/")
                    out.append((resp.status_code, resp.content))
                return out
        finally:
            srv.close()

    return asyncio.run(main()), seen


def test_an_informational_answer_is_skipped_for_the_real_one():
    answers, _ = _raw_server_run(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc"
    )
    assert answers == [(201, b"abc")]


def test_a_body_without_length_ends_at_close_and_its_connection_is_not_kept():
    answers, seen = _raw_server_run(b"HTTP/1.1 200 OK\r\n\r\n" + b"z" * 100_000, requests=2)
    assert answers == [(200, b"z" * 100_000)] * 2
    assert seen["conns"] == 2


def test_a_chunked_answer_arrives_whole_and_its_connection_is_reused():
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    answers, seen = _raw_server_run(chunked, requests=3, close=False)
    assert answers == [(200, b"abcde")] * 3
    assert seen["conns"] == 1


def test_bytes_after_an_answer_mean_its_connection_is_not_reused():
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Len"
    answers, seen = _raw_server_run(answer, requests=2, close=False)
    assert answers == [(200, b"ok")] * 2
    assert seen["conns"] == 2


def test_an_answer_head_past_the_bound_is_a_protocol_error():
    huge = b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"p" * (MAX_HEAD + 10) + b"\r\n\r\n"
    with pytest.raises(httpx.RemoteProtocolError, match="head over"):
        _raw_server_run(huge)


@pytest.mark.parametrize("value", ["a\r\nx-evil: 1", "a\nb", "a\x00b"])
def test_a_header_value_that_would_add_a_line_is_refused_before_anything_is_sent(value):
    async def main() -> None:
        async with _client() as c:
            await c.get(f"http://127.0.0.1:{free_port()}/", headers={"x-request-id": value})

    with pytest.raises(httpx.LocalProtocolError, match="x-request-id"):
        asyncio.run(main())


def _close_unanswered_run(method: str) -> tuple[BaseException | int, list[bytes]]:
    """Two requests; the backend answers the first and keeps the connection, reads the second
    whole and closes without a word (it may have acted on it); any other connection is answered.
    The second's status (or error) and the request lines the backend read."""
    lines: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = not lines
        try:
            for _ in range(2 if first else 1):
                lines.append((await reader.readuntil(b"\r\n\r\n")).split(b"\r\n", 1)[0])
                if not (first and len(lines) == 2):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
        finally:
            writer.close()

    async def main() -> BaseException | int:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            async with _client() as c:
                for path in ("/one", "/two"):
                    try:
                        resp = await c.request(method, f"http://127.0.0.1:{port}{path}")
                    except httpx.HTTPError as exc:
                        return exc
                return resp.status_code
        finally:
            srv.close()

    return asyncio.run(main()), lines


def test_a_post_whose_kept_connection_closed_unanswered_is_not_sent_again():
    """A prefill that read it may hold KV for it, a decode may have run it: a second copy would
    pin a hold nobody reads or decode twice."""
    outcome, lines = _close_unanswered_run("POST")
    assert isinstance(outcome, httpx.RemoteProtocolError), outcome
    assert "closed the connection before answering" in str(outcome)
    assert lines == [b"POST /one HTTP/1.1", b"POST /two HTTP/1.1"]


def test_a_get_whose_kept_connection_closed_unanswered_is_retried_once():
    outcome, lines = _close_unanswered_run("GET")
    assert outcome == 200
    assert lines == [b"GET /one HTTP/1.1", b"GET /two HTTP/1.1", b"GET /two HTTP/1.1"]


def test_a_kept_connection_the_server_closed_is_not_reused_even_before_the_loop_saw_it():
    """The close is in the kernel, not yet read by the event loop: a POST still goes out on a
    fresh connection, once, and is answered."""
    answered, closed = threading.Event(), threading.Event()
    lines: list[bytes] = []
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def serve() -> None:
        with contextlib.suppress(OSError):  # TimeoutError too: the client never came back
            for n in range(2):
                conn, _ = listener.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                        data += chunk
                    lines.append(data.split(b"\r\n", 1)[0])
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    if n == 0:
                        answered.wait(30)  # the client has read the answer and kept the link
                closed.set()

    async def main(port: int) -> list[int]:
        transport = KeptTransport(ssl.create_default_context())
        codes = []
        try:
            for path in ("/one", "/two"):
                request = httpx.Request("POST", f"http://127.0.0.1:{port}{path}", content=b"x")
                resp = await transport.handle_async_request(request)
                await resp.aread()
                await resp.aclose()
                codes.append(resp.status_code)
                answered.set()
                closed.wait(30)  # blocks the loop: the server's close stays unread by it
        finally:
            await transport.aclose()
        return codes

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        codes = asyncio.run(main(listener.getsockname()[1]))
    finally:
        server.join(30)
        listener.close()
    assert codes == [200, 200]
    assert lines == [b"POST /one HTTP/1.1", b"POST /two HTTP/1.1"]
