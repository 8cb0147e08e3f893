"""The optional speed-ups a daemon runs on (uvloop for the event loop, httptools for HTTP), and
``Wake``, the cheap interruptible sleep of the sidecar's polling loops.

Every daemon entry point (``kvxferd serve``, ``sim``, ``proxy``) calls ``run`` instead of
``asyncio.run``: they start their own loop, so uvicorn's ``loop`` setting never applies. The
HTTP listeners pick their parser with :func:`http_parser` (kvxferd.api.limits).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvxferd.errors import ConfigError

T = TypeVar("T")

EVENT_LOOPS = ("auto", "asyncio", "uvloop")
"""Accepted values of ``--event-loop`` / ``KVXFERD_EVENT_LOOP``: auto = uvloop if importable."""


def check_event_loop(name: str) -> str:
    """``name`` if it is one of EVENT_LOOPS, else ConfigError naming the setting."""
    if name not in EVENT_LOOPS:
        raise ConfigError(f"event_loop: {name!r} is not one of {', '.join(EVENT_LOOPS)}")
    return name


def loop_factory(name: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for ``name`` (None = asyncio's default loop).

    ``uvloop`` asked for by name and missing is a ConfigError; ``auto`` falls back quietly.
    """
    check_event_loop(name)
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise ConfigError("event_loop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def loop_name(name: str = "auto") -> str:
    """The loop ``run(coro, name)`` would use: ``uvloop`` or ``asyncio``."""
    return "asyncio" if loop_factory(name) is None else "uvloop"


def run(main: Coroutine[Any, Any, T], event_loop: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop ``event_loop`` names (see ``loop_factory``)."""
    try:
        factory = loop_factory(event_loop)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


HTTP_PARSERS = ("auto", "httptools", "h11")
"""Accepted values of ``KVXFERD_HTTP`` (``Config.http``, ``EdgeLimits.http``): auto = httptools
if importable."""


def check_http(name: str) -> str:
    """``name`` if it is one of HTTP_PARSERS (and installed), else ConfigError naming it."""
    if name not in HTTP_PARSERS:
        raise ConfigError(f"http: {name!r} is not one of {', '.join(HTTP_PARSERS)}")
    if name == "httptools" and not _httptools():
        raise ConfigError("http: httptools is not installed (pip install httptools)")
    return name


def http_parser(name: str = "auto") -> str:
    """The parser ``name`` selects: ``httptools`` or ``h11``."""
    check_http(name)
    return "httptools" if name != "h11" and _httptools() else "h11"


def _httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True


async def wait_while(busy: Callable[[], bool], changed: asyncio.Event, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` while ``busy()``, checking it again each time ``changed`` is
    set (its setter's signal that the answer may have changed; cleared here before each wait)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while busy() and (left := deadline - asyncio.get_running_loop().time()) > 0:
        changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), left)


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Wake:
    """A wake-up flag a polling loop sleeps on with a timeout: ``set`` wakes a sleeping ``sleep``
    early; the flag stays set until ``clear``. Loop-thread only, like ``asyncio.Event``.

    One future and one timer per sleep: ``asyncio.wait_for(event.wait(), t)`` made a task per
    sleep and raised on every timeout, most of the prefill's notification poller CPU at TP 8
    (scripts/bench_pulls.py, issue 11). The completion poller's backoff sleeps on one too.
    """

    def __init__(self) -> None:
        self._set = False
        self._sleeper: asyncio.Future[bool] | None = None

    def is_set(self) -> bool:
        return self._set

    @property
    def sleeping(self) -> bool:
        """Whether a ``sleep`` is waiting right now."""
        return self._sleeper is not None

    def set(self) -> None:
        self._set = True
        fut = self._sleeper
        if fut is not None and not fut.done():
            fut.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def sleep(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; whether the flag was (or got) set."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, fut)
        self._sleeper = fut
        try:
            return await fut
        finally:
            timer.cancel()
            self._sleeper = None


class Cork:
    """A stream writer whose writes of one loop round leave together, as one send.

    Tasks that write to one connection in the same round (the answers and claims of many pulls
    in flight) then cost the sender one syscall and the receiver one wake-up, not one each: at
    64 pulls in flight 0.6 -> 0.5 ms of decode CPU a pull, and half the prefill CPU of a pull
    from prefill TP 8 (scripts/bench_pulls.py). A lone write leaves once the round's other
    ready callbacks ran (microseconds). Only the loop's thread may use it."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._parts: list[bytes] = []
        self._sent: asyncio.Future[None] | None = None  # done once this round's parts left

    def write(self, data: bytes) -> None:
        """Queue ``data``; the round's writes go out together once the round ends."""
        if not self._parts:
            loop = asyncio.get_running_loop()
            loop.call_soon(self._flush)
            self._sent = loop.create_future()
        self._parts.append(data)

    async def drain(self) -> None:
        """Wait until what was written left for the transport and its buffer is below its high
        mark (``StreamWriter.drain``: a peer that does not read stops us here)."""
        if self._sent is not None and not self._sent.done():
            await asyncio.shield(self._sent)  # shared by the round's writers: never cancelled
        await self.writer.drain()

    def _flush(self) -> None:
        parts, self._parts = self._parts, []
        sent, self._sent = self._sent, None
        try:
            if parts and not self.writer.is_closing():
                self.writer.write(parts[0] if len(parts) == 1 else b"".join(parts))
        except BaseException:
            self.writer.transport.abort()  # the round's bytes are lost: its calls must fail
            raise  # to the loop's exception handler (logged)
        finally:
            if sent is not None and not sent.done():
                sent.set_result(None)  # the drainers go on (and find the connection closed)
