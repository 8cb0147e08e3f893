"""kvxferd.aio: the daemons run on uvloop when it is installed, on asyncio when told or when it
is not, and a loop that cannot be had is a ConfigError before anything runs."""

from __future__ import annotations

import argparse
import asyncio
import sys

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
