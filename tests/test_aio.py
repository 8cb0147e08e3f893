"""kvxferd.aio: the daemons run on uvloop when it is installed, on asyncio when told or when it
is not, and a loop that cannot be had is a ConfigError before anything runs. ``Wake``: a polling
loop's sleep that an event cuts short, with no task per sleep. ``Cork``: the writes of one loop
round leave a connection as one send."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator

import pytest

from kvxferd import aio
from kvxferd.commands.edge import add_event_loop_flag, event_loop_from_args
from kvxferd.errors import ConfigError


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_runs_on_the_standard_loop():
    assert aio.run(_loop_module(), "asyncio").startswith("asyncio")
    assert aio.loop_name("asyncio") == "asyncio"


def test_auto_and_uvloop_run_on_uvloop_when_it_is_installed():
    pytest.importorskip("uvloop")
    assert aio.run(_loop_module(), "auto").startswith("uvloop")
    assert aio.run(_loop_module(), "uvloop").startswith("uvloop")
    assert aio.loop_name() == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert aio.run(_loop_module(), "auto").startswith("asyncio")
    coro = _loop_module()
    with pytest.raises(ConfigError, match="^event_loop: uvloop is not installed"):
        aio.run(coro, "uvloop")
    assert coro.cr_frame is None  # closed, never left pending


def test_an_unknown_loop_name_is_a_config_error_naming_the_setting():
    with pytest.raises(ConfigError, match="^event_loop: 'fast' is not one of auto, asyncio"):
        aio.run(_loop_module(), "fast")


def test_run_returns_the_result_and_raises_what_the_coroutine_raises():
    async def fails() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        aio.run(fails(), "asyncio")


def _from(argv: list[str], env: dict[str, str]) -> str:
    parser = argparse.ArgumentParser()
    add_event_loop_flag(parser)
    return event_loop_from_args(parser.parse_args(argv), env)


def test_sim_and_proxy_take_the_flag_then_the_environment_then_auto():
    assert _from([], {}) == "auto"
    assert _from([], {"KVXFERD_EVENT_LOOP": "asyncio"}) == "asyncio"
    assert _from(["--event-loop", "uvloop"], {"KVXFERD_EVENT_LOOP": "asyncio"}) == "uvloop"
    with pytest.raises(ConfigError, match="^KVXFERD_EVENT_LOOP: "):
        _from([], {"KVXFERD_EVENT_LOOP": "tokio"})


def test_the_http_parser_is_httptools_when_installed_unless_h11_is_asked_for():
    pytest.importorskip("httptools")
    assert aio.http_parser() == aio.http_parser("httptools") == "httptools"
    assert aio.http_parser("h11") == "h11"


def test_without_httptools_auto_falls_back_to_h11_and_httptools_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "httptools", None)  # import httptools -> ImportError
    assert aio.http_parser("auto") == "h11"
    with pytest.raises(ConfigError, match="^http: httptools is not installed"):
        aio.http_parser("httptools")
    with pytest.raises(ConfigError, match="^http: 'h2' is not one of auto, httptools, h11"):
        aio.check_http("h2")


def test_sleep_times_out_false_when_nobody_sets_the_flag():
    async def scenario() -> None:
        wake = aio.Wake()
        assert await wake.sleep(0.001) is False
        assert not wake.is_set()

    asyncio.run(scenario())


def test_set_ends_a_sleep_early_and_stays_set_until_cleared():
    async def scenario() -> None:
        wake = aio.Wake()
        sleeping = asyncio.create_task(wake.sleep(60.0))
        await asyncio.sleep(0)
        assert wake.sleeping
        wake.set()
        assert await asyncio.wait_for(sleeping, 10.0) is True
        assert await wake.sleep(60.0) is True  # still set: returns at once
        wake.clear()
        assert await wake.sleep(0.001) is False

    asyncio.run(scenario())


def test_a_cancelled_sleep_leaves_the_wake_usable():
    async def scenario() -> None:
        wake = aio.Wake()
        sleeping = asyncio.create_task(wake.sleep(60.0))
        await asyncio.sleep(0)
        sleeping.cancel()
        await asyncio.gather(sleeping, return_exceptions=True)
        assert sleeping.cancelled()
        wake.set()  # no sleeper left to wake: just the flag
        assert await wake.sleep(60.0) is True

    asyncio.run(scenario())


# -- Cork: the writes of one loop round leave as one send ------------------------------------


@contextlib.asynccontextmanager
async def _corked_pair() -> AsyncIterator[tuple[aio.Cork, list[bytes], socket.socket]]:
    """A Cork over one end of a socket pair, the sends it made, and the other end (both ends
    closed after)."""
    ours, theirs = socket.socketpair()
    _, writer = await asyncio.open_connection(sock=ours)
    sends: list[bytes] = []
    write = writer.write
    writer.write = lambda data: (sends.append(bytes(data)), write(data))[1]  # type: ignore[method-assign]
    theirs.setblocking(False)
    try:
        yield aio.Cork(writer), sends, theirs
    finally:
        writer.transport.abort()
        theirs.close()


async def _received(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(5):
        while len(got) < size:
            got += await loop.sock_recv(sock, size - len(got))
    return got


def test_the_writes_of_tasks_in_one_round_leave_as_one_send_in_their_order():
    async def main():
        async with _corked_pair() as (cork, sends, theirs):

            async def call(data: bytes) -> None:
                cork.write(data)
                await cork.drain()

            await asyncio.gather(call(b"one,"), call(b"two,"), call(b"three"))
            assert sends == [b"one,two,three"]
            assert await _received(theirs, 13) == b"one,two,three"

    asyncio.run(main())


def test_a_write_waits_for_the_end_of_its_round_and_a_later_round_sends_again():
    async def main():
        async with _corked_pair() as (cork, sends, theirs):
            cork.write(b"first")
            assert sends == []  # still this round
            await cork.drain()
            assert sends == [b"first"]
            cork.write(b"second")
            await cork.drain()
            assert sends == [b"first", b"second"]
            assert await _received(theirs, 11) == b"firstsecond"

    asyncio.run(main())


def test_a_round_written_after_the_connection_closed_is_dropped_and_drain_ends():
    async def main():
        async with _corked_pair() as (cork, sends, theirs):
            cork.writer.transport.abort()
            cork.write(b"lost")
            async with asyncio.timeout(5):
                with contextlib.suppress(ConnectionError):
                    await cork.drain()
            assert sends == []

    asyncio.run(main())


def test_a_send_that_raises_closes_the_connection_and_releases_the_drainers():
    async def main():
        async with _corked_pair() as (cork, _, theirs):
            loop = asyncio.get_running_loop()
            errors: list[BaseException] = []
            loop.set_exception_handler(lambda _, ctx: errors.append(ctx.get("exception")))

            def broken(data: bytes) -> None:
                raise RuntimeError("the transport refused the bytes")

            cork.writer.write = broken  # type: ignore[method-assign]
            cork.write(b"lost")
            async with asyncio.timeout(5):
                with contextlib.suppress(ConnectionError):
                    await cork.drain()
            assert cork.writer.transport.is_closing()  # its calls fail instead of waiting
            assert [type(e) for e in errors] == [RuntimeError]

    asyncio.run(main())
