"""The optional speed-ups a daemon runs on: uvloop for the event loop, httptools for HTTP.

Every daemon entry point (``kvxferd serve``, ``sim``, ``proxy``) calls ``run`` instead of
``asyncio.run``: they start their own loop, so uvicorn's ``loop`` setting never applies. The
HTTP listeners pick their parser with :func:`http_parser` (kvxferd.api.limits).
"""

from __future__ import annotations

import asyncio
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
