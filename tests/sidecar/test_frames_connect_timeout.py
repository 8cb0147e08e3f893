"""A framed peer port whose connections do not open in time (a listener whose accept queue is
full drops new SYNs: a flood) sends that call over HTTP, and the calls of a bounded wait after
it; then the port is tried again, never given up on until the next handshake. Calls waiting on
the connect that timed out fail with it instead of each waiting for a connect of its own.
Real listeners on loopback: one of backlog 0 whose queue one connection fills."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvxferd import frameconn
from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.operations import Gate
from kvxferd.api.peer import FRAME_OPERATIONS
from kvxferd.frameconn import AsyncFrameConn, FrameConnectTimeoutError
from kvxferd.sidecar import peer_clients, peers
from kvxferd.sidecar.peers import Peer, PeerTable
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.wire import Heartbeat, HeartbeatResponse

CONNECT_S = 0.2
ASKED = Heartbeat(hold_ids=["h"], extend_s=1.0)


@contextlib.contextmanager
def _full_listener():
    """A TCP listener nobody accepts on, its accept queue (backlog 0) full: connects time out."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    filler = socket.create_connection(listener.getsockname(), timeout=5.0)
    try:
        yield listener
    finally:
        filler.close()
        listener.close()


class _Prefill:
    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        return HeartbeatResponse(extended=list(req.hold_ids), missing=[])


@contextlib.asynccontextmanager
async def _http() -> AsyncIterator[str]:
    """An HTTP peer answering every heartbeat: every hold extended."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n")
                              if x.lower().startswith(b"content-length"))  # fmt: skip
                req = msgspec.json.decode(await reader.readexactly(length), type=Heartbeat)
                data = msgspec.json.encode(_Prefill().heartbeat(req))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


class _Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def _table(address: str, port: int, clock: _Clock, calls: list[str]) -> PeerTable:
    async def add(_: bytes) -> str:
        raise AssertionError("no handshake here")

    async def remove(_: str) -> None:
        return None

    table = PeerTable(
        local_handshake=lambda: None,  # type: ignore[arg-type, return-value]
        add_agent=add, remove_agent=remove, check_compatible=lambda _: {},
        keys=PeerKeys.of("s"), timeout_s=5.0, on_call=lambda _call, wire: calls.append(wire),
        clock=clock,
    )  # fmt: skip
    table._adopt(address, Peer(address, "e", 1, "a", None, (), frames_port=port))  # type: ignore[arg-type]
    return table


@pytest.fixture(autouse=True)
def _short_connects(monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(peer_clients, "CONNECT_S", CONNECT_S)


def test_a_framed_connect_timeout_sends_calls_over_http_for_a_while_then_frames_again():
    async def scenario() -> tuple[list[str], list[object]]:
        clock, calls, seen = _Clock(), [], []
        with _full_listener() as listener:
            async with _http() as address:
                table = _table(address, listener.getsockname()[1], clock, calls)
                try:
                    await asyncio.wait_for(table.heartbeat(address, ASKED), 10.0)  # times out
                    seen.append((address in table._http_only, table._frames_wait[address]))
                    gate = Gate(ready=lambda: True, verify=lambda *_: None)
                    server = FrameServer(FRAME_OPERATIONS, _Prefill(), gate,
                                         FrameLimits(8, max_frame_bytes=1 << 20))  # fmt: skip
                    await server.start(listener)  # the port accepts again (the flood ended)
                    try:
                        # within the wait: over HTTP, though the port would answer now
                        await asyncio.wait_for(table.heartbeat(address, ASKED), 10.0)
                        clock.t += peers.FRAMES_RETRY_S  # the wait is over: frames again
                        answer = await asyncio.wait_for(table.heartbeat(address, ASKED), 10.0)
                        seen.append((answer.extended, address in table._frames_wait))
                    finally:
                        await server.close(grace_s=1.0)
                finally:
                    await table.close()
        return calls, seen

    calls, seen = asyncio.run(scenario())
    assert calls == ["http", "http", "frames"]
    assert seen == [(False, (1, 100.0 + peers.FRAMES_RETRY_S)), (["h"], False)]


def test_framed_connect_timeouts_in_a_row_double_the_wait_to_its_bound(monkeypatch):
    monkeypatch.setattr(peers, "FRAMES_RETRY_MAX_S", 3.0)

    async def scenario() -> tuple[list[str], list[tuple[int, float]]]:
        clock, calls, waits = _Clock(), [], []
        with _full_listener() as listener:
            async with _http() as address:
                table = _table(address, listener.getsockname()[1], clock, calls)
                try:
                    for _ in range(3):
                        await asyncio.wait_for(table.heartbeat(address, ASKED), 10.0)
                        waits.append(table._frames_wait[address])
                        assert address not in table._http_only  # never given up on
                        clock.t = waits[-1][1]  # the wait is over: the next call tries frames
                finally:
                    await table.close()
        return calls, waits

    calls, waits = asyncio.run(scenario())
    assert calls == ["http"] * 3
    assert waits == [(1, 101.0), (2, 103.0), (3, 106.0)]  # 1 s, 2 s, then 3 s (not 4: the bound)


def test_calls_waiting_on_a_connect_that_timed_out_fail_with_it_without_connecting_again(
    monkeypatch,
):
    opened: list[tuple[str, int]] = []
    real_open = asyncio.open_connection

    async def counting(host: str, port: int, **kw: object):  # noqa: ANN202
        opened.append((host, port))
        return await real_open(host, port, **kw)

    monkeypatch.setattr(frameconn.asyncio, "open_connection", counting)

    async def scenario() -> list[BaseException | tuple]:
        with _full_listener() as listener:
            host, port = listener.getsockname()[:2]
            conn = AsyncFrameConn(f"{host}:{port}", 10.0, tcp=(host, port),
                                  connect_timeout_s=CONNECT_S)  # fmt: skip
            try:
                return await asyncio.gather(
                    *(conn.call("POST /v1/heartbeat", None, msgspec.Raw(b"\x80"))
                      for _ in range(5)),
                    return_exceptions=True,
                )  # fmt: skip
            finally:
                await conn.aclose()

    results = asyncio.run(scenario())
    assert all(isinstance(r, FrameConnectTimeoutError) for r in results), results
    assert len(opened) == 1  # one connect for the five calls, not five in turn
