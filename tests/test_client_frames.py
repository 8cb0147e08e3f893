"""The engine client over frames (``frames=True``): a real pull between two ``kvxferd serve``
processes with every byte checked, the same Structs and error classes as over HTTP, every call
bounded, a dropped connection replaced, and every connection closed on close()."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from kvxferd import errors
from kvxferd.api.frames import FrameLimits
from kvxferd.client import (
    AsyncEngineClient,
    EngineClient,
    SidecarUnreachableError,
    frames_available,
)
from kvxferd.pattern import verify_token_pattern, write_token_pattern
from kvxferd.wire import HoldRequest, PullRequest
from tests.api.conftest import FakeSidecar
from tests.api.frameio import BOUND_S, served
from tests.api.test_frame_limits import GatedFake
from tests.sidecar.harness import (
    EnginePool,
    changed_outside,
    plan,
    start_sidecars,
    wait_until,
)

TOKENS = 40  # 3 blocks of 16, the last partly filled


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill and a decode sidecar, each with a registered 8-block llama pool."""
    sidecars = start_sidecars(str(tmp_path_factory.mktemp("cf")), ["p", "d"])
    pools = [EnginePool(plan("llama-3.1-8b", num_blocks=8)) for _ in sidecars]
    try:
        for s, pool in zip(sidecars, pools, strict=True):
            with EngineClient(s.socket, frames=True) as client:
                client.register(pool.manifest, pool.specs())
            s.pool = pool
        yield sidecars
    finally:
        for s in sidecars:
            assert s.stop() == 0
        for pool in pools:
            pool.close()


def _hold(block_ids: list[list[int]], tokens: int = TOKENS) -> HoldRequest:
    return HoldRequest(request_id=f"r-{uuid.uuid4().hex[:8]}", block_ids=block_ids,
                       num_tokens=tokens)  # fmt: skip


def test_frames_are_found_beside_a_sidecars_engine_socket(pair, tmp_path):
    assert frames_available(pair[0].socket)
    assert not frames_available(str(tmp_path / "nothing.sock"))


def test_a_pull_over_frames_moves_every_byte_and_nothing_else(pair):
    prefill, decode = pair
    src, dst = [[1, 2, 3]], [[5, 6, 7]]
    write_token_pattern(prefill.pool.manifest, prefill.pool.views, src, TOKENS, seed=7)
    before = decode.pool.snapshot()
    with (
        EngineClient(prefill.socket, frames=True) as p,
        EngineClient(decode.socket, frames=True) as d,
    ):
        ticket = p.hold(_hold(src))
        cursor = d.finished_pulls().cursor
        status = d.run_pull(PullRequest(tickets=[ticket], block_ids=dst, num_tokens=TOKENS))
        assert status.state == "done", status
        assert [f.pull_id for f in d.finished_pulls(cursor).pulls] == [status.pull_id]
        wait_until(lambda: ticket.hold_id in [h.hold_id for h in p.released(0).holds],
                   BOUND_S, "the hold released by the READ's notification")  # fmt: skip
    assert verify_token_pattern(decode.pool.manifest, decode.pool.views, dst, TOKENS, 7) is None
    assert changed_outside(before, decode.pool.snapshot(), decode.pool.manifest, dst) == 0


def test_the_async_client_pulls_over_frames_too(pair):
    prefill, decode = pair
    src, dst = [[4]], [[1]]
    write_token_pattern(prefill.pool.manifest, prefill.pool.views, src, 16, seed=9)

    async def scenario() -> None:
        async with (
            AsyncEngineClient(prefill.socket, frames=True) as p,
            AsyncEngineClient(decode.socket, frames=True) as d,
        ):
            ticket = await p.hold(_hold(src, 16))
            accepted = await d.pull(PullRequest(tickets=[ticket], block_ids=dst, num_tokens=16))
            status = await d.wait_pull(accepted.pull_id, timeout_s=BOUND_S)
            assert status.state == "done", status
            idents = await asyncio.gather(*[p.identity() for _ in range(32)])
            assert {i.engine_id for i in idents} == {prefill.engine_id}

    asyncio.run(scenario())
    assert verify_token_pattern(decode.pool.manifest, decode.pool.views, dst, 16, 9) is None


def _errors_of(client: EngineClient, registered: EnginePool) -> list[tuple]:
    """(class, status, field) of a few refusals, as the client raises them."""
    out = []
    dup = _hold([[2]])
    client.hold(dup)
    for bad in (
        lambda: client.hold(_hold([[1, 99]])),
        lambda: client.hold(dup),
        lambda: client.hold(HoldRequest(request_id="r", block_ids=[["x"]], num_tokens=1)),  # type: ignore[list-item]
        lambda: client.pull_status("nope"),
        lambda: client.abort("nope"),
        lambda: client.register(registered.manifest, registered.specs()),
    ):
        with pytest.raises(errors.KvxferdError) as info:
            bad()
        exc = info.value
        out.append((type(exc), exc.status, getattr(exc, "field", ""), exc.body.error))
    return out


def test_errors_are_the_same_classes_statuses_and_fields_as_over_http(pair):
    prefill = pair[0]
    with EngineClient(prefill.socket, frames=True) as framed, EngineClient(prefill.socket) as http:
        got = _errors_of(framed, prefill.pool)
        assert got == _errors_of(http, prefill.pool)
    assert [g[1] for g in got] == [422, 409, 422, 404, 404, 409]
    assert got[0][2] == "block_ids[0][1]" and got[2][2] == "block_ids[0][0]"


def test_a_missing_socket_is_unreachable_without_a_status(tmp_path):
    with (
        EngineClient(str(tmp_path / "none.sock"), frames=True) as client,
        pytest.raises(SidecarUnreachableError) as info,
    ):
        client.healthz()
    assert info.value.status is None

    async def scenario() -> None:
        async with AsyncEngineClient(str(tmp_path / "none.sock"), frames=True) as client:
            with pytest.raises(SidecarUnreachableError):
                await client.healthz()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ connection logic
# Against a FrameServer in-process (the fake stands in for the sidecar's answers only).


@pytest.fixture
def path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvxc-") as tmp:
        yield f"{tmp}/e.sock"


def _limits(**kw: object) -> FrameLimits:
    return FrameLimits(**{"max_connections": 8, "max_frame_bytes": 1 << 16, **kw})  # type: ignore[arg-type]


def test_a_call_without_an_answer_ends_at_its_timeout_and_the_next_call_is_answered(path):
    fake = GatedFake()
    with served(path + ".frames", fake, _limits()) as server:
        with EngineClient(path, timeout_s=0.3, frames=True) as client:
            with pytest.raises(SidecarUnreachableError) as info:
                client.keepalive([], 1.0)  # the fake holds it until released
            assert info.value.status is None and "no answer in time (0.3 s)" in str(info.value)
            client.healthz()
            fake.release.set()
            assert client.keepalive([], 1.0).extended == []
        wait_until(lambda: server.connections == 0, BOUND_S, "connections released")


def test_the_async_client_bounds_each_call_and_keeps_serving_the_others(path):
    fake = GatedFake()

    async def scenario() -> None:
        async with AsyncEngineClient(path, timeout_s=0.3, frames=True) as client:
            slow = asyncio.create_task(client.keepalive([], 1.0))
            await client.healthz()  # answered while the slow call waits
            with pytest.raises(SidecarUnreachableError):
                await slow
            fake.release.set()
            assert (await client.keepalive([], 1.0)).extended == []

    with served(path + ".frames", fake, _limits()) as server:
        asyncio.run(scenario())
        wait_until(lambda: server.connections == 0, BOUND_S, "connections released")


def test_a_connection_the_server_dropped_is_replaced_before_the_next_call(path):
    with served(path + ".frames", FakeSidecar(), _limits(idle_timeout_s=0.1)) as server:
        with EngineClient(path, frames=True) as client:
            client.healthz()
            wait_until(lambda: server.connections == 0, BOUND_S, "the idle connection dropped")
            client.healthz()  # no error: a new connection

        async def scenario() -> None:
            async with AsyncEngineClient(path, frames=True) as client:
                await client.healthz()
                # Waited for without yielding: the loop has not read the server's close when
                # the next call comes, so only the idle link's poll can see it.
                wait_until(lambda: server.connections == 0, BOUND_S, "dropped")
                await client.healthz()

        asyncio.run(scenario())


def test_close_releases_every_connection(path):
    with served(path + ".frames", FakeSidecar(), _limits()) as server:
        client = EngineClient(path, frames=True)
        client.healthz()
        assert server.connections == 1
        client.close()
        wait_until(lambda: server.connections == 0, BOUND_S, "sync connection closed")

        async def scenario() -> None:
            client = AsyncEngineClient(path, frames=True)
            await asyncio.gather(*[client.healthz() for _ in range(10)])
            assert server.connections == 1  # the calls share one connection
            await client.aclose()

        asyncio.run(scenario())
        wait_until(lambda: server.connections == 0, BOUND_S, "async connection closed")


def test_blocking_calls_from_several_threads_run_side_by_side(path):
    fake = GatedFake()
    with served(path + ".frames", fake, _limits()) as server:
        with EngineClient(path, frames=True) as client:
            slow = threading.Thread(target=client.keepalive, args=([], 1.0))
            slow.start()
            wait_until(lambda: fake.waiting == 1, BOUND_S, "the slow call to start")
            client.healthz()  # answered while the other thread's call waits
            assert server.connections == 2
            fake.release.set()
            slow.join(BOUND_S)
            assert not slow.is_alive()
        wait_until(lambda: server.connections == 0, BOUND_S, "connections released")


def test_an_answer_frame_nested_too_deeply_is_unreadable_and_fails_only_its_connection(path):
    # msgspec raises RecursionError (no MsgspecError) for a value nested ~1,000 deep, even in a
    # field it skips: that killed the connection's reader task with an unexpected exception.
    from kvxferd.frameconn import AsyncFrameConn, FrameLinkError
    from kvxferd.wire.frames import frame

    deep = 100_000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        writer.write(frame(b"\x84\xa2id\x01\xa6status\xcc\xc8\xa4body\xc0\xa1x"
                           + b"\x91" * deep + b"\xc0"))  # fmt: skip
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(answer, path)
        conn = AsyncFrameConn(path, 5.0)
        try:
            with pytest.raises(FrameLinkError, match="unreadable answer frame"):
                await conn.call("GET /healthz", None, msgspec.Raw(b"\xc0"))
            link = conn._link
            assert link is not None and link.closed
            await asyncio.wait_for(link.task, 5.0)  # ended by itself, with no exception
        finally:
            await conn.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_late_or_unasked_answer_frame_is_never_taken_as_another_calls_answer(path):
    # A benign slow peer answers a call after it timed out, and (a confused one) answers a call
    # never made, on the connection the next call shares: answers go by id, those are dropped.
    from kvxferd.frameconn import AsyncFrameConn, FrameLinkError
    from kvxferd.wire import FrameAnswer, FrameRequest
    from kvxferd.wire.frames import frame, frame_length

    def answer(call_id: int, body: bytes) -> bytes:
        return frame(msgspec.msgpack.encode(FrameAnswer(call_id, 200, msgspec.Raw(body))))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slow: list[int] = []
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                size = frame_length(await reader.readexactly(4))
                req = msgspec.msgpack.decode(await reader.readexactly(size), type=FrameRequest)
                if bytes(req.body) == msgspec.msgpack.encode("slow"):
                    slow.append(req.id)  # answered only once the next request came
                    continue
                stale = b"".join(answer(i, msgspec.msgpack.encode("slow")) for i in slow)
                stray = answer(req.id + 1, msgspec.msgpack.encode("stray"))
                writer.write(stale + stray + answer(req.id, bytes(req.body)))
                await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(serve, path)
        conn = AsyncFrameConn(path, 0.3)
        try:
            with pytest.raises(FrameLinkError, match="no answer in time"):
                await conn.call("POST /x", None, msgspec.Raw(msgspec.msgpack.encode("slow")))
            for n in range(2):  # the stray answer names the second call's id
                body = msgspec.msgpack.encode(f"mine {n}")
                status, raw = await conn.call("POST /x", None, msgspec.Raw(body))
                assert (status, bytes(raw)) == (200, body)
        finally:
            await conn.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def test_a_connection_closed_before_any_answer_is_refused_and_one_closed_after_is_not(path):
    # A listener at its connection cap closes what it accepts, unread: nothing sent on it was
    # taken (a caller may send it elsewhere). Closed after answering, the calls it carried may
    # have been taken: a plain link error.
    from kvxferd.api.frames import FrameServer
    from kvxferd.api.operations import Gate
    from kvxferd.frameconn import AsyncFrameConn, FrameLinkError, FrameRefusedError
    from kvxferd.wire import FrameAnswer
    from kvxferd.wire.frames import frame, frame_length

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        size = frame_length(await reader.readexactly(4))
        await reader.readexactly(size)
        writer.write(frame(msgspec.msgpack.encode(FrameAnswer(1, 204))))
        await writer.drain()
        await reader.readexactly(4)  # the second call's frame: closed unanswered
        writer.transport.abort()

    async def scenario() -> None:
        full = FrameServer([], None, Gate(), _limits(max_connections=0))
        await full.start(_listening(path + ".full"))
        conn = AsyncFrameConn(path + ".full", 5.0)
        with pytest.raises(FrameRefusedError):
            await conn.call("GET /healthz", None, msgspec.Raw(b"\xc0"))
        await conn.aclose()
        await full.close()
        server = await asyncio.start_unix_server(once, path)
        conn = AsyncFrameConn(path, 5.0)
        try:
            assert (await conn.call("GET /healthz", None, msgspec.Raw(b"\xc0")))[0] == 204
            with pytest.raises(FrameLinkError) as info:
                await conn.call("GET /healthz", None, msgspec.Raw(b"\xc0"))
            assert not isinstance(info.value, FrameRefusedError)
        finally:
            await conn.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


def _listening(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock
