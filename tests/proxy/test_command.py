"""``kvxferd proxy`` as an operator runs it: ready line, health of its backends, clean stop."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

import httpx
import pytest

from kvxferd.api.limits import EdgeLimits
from kvxferd.commands.edge import add_limit_flags, limits_from_args
from kvxferd.errors import ConfigError
from tests.proxy.fakes import FakeBackend, fake_app, free_port, proxy_process, serve_app


def test_proxy_command_prints_ready_serves_and_stops_on_sigint() -> None:
    decode = serve_app(fake_app(FakeBackend("D0", "decode")))
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        with proxy_process("--prefill", dead, "--decode", decode.url, "--port", "0",
                           "--timeout", "2") as (proc, url):  # fmt: skip
            with httpx.Client(base_url=url, timeout=30) as c:
                health = c.get("/health")
                failed = c.post("/v1/completions", json={"model": "m", "prompt": "x"})
            assert health.status_code == 503 and health.json()["down"] == [dead]
            assert failed.status_code == 502 and dead in failed.json()["error"]["message"]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 0
    finally:
        decode.stop()


def test_bad_backend_url_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", "localhost:8100",
         "--decode", "http://127.0.0.1:1", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--prefill: 'localhost:8100' is not an http(s) URL" in done.stderr


def _limits(argv: list[str], env: dict[str, str]) -> EdgeLimits:
    parser = argparse.ArgumentParser()
    add_limit_flags(parser)
    return limits_from_args(parser.parse_args(argv), env)


def test_edge_limits_come_from_flags_then_the_shared_env_then_front_door_defaults() -> None:
    assert _limits([], {}) == EdgeLimits(1024, 16384, 32 << 20, 10.0, 30.0)
    env = {"KVXFERD_BODY_TIMEOUT_S": "5", "KVXFERD_HEADER_TIMEOUT_S": "4",
           "KVXFERD_MAX_HEADER_BYTES": "8192", "KVXFERD_MAX_BODY_BYTES": "1"}  # fmt: skip
    got = _limits(["--body-timeout", "2", "--max-connections", "9"], env)
    # the sidecar's body limit is not the front door's: KVXFERD_MAX_BODY_BYTES is not read
    assert got == EdgeLimits(9, 8192, 32 << 20, 4.0, 2.0)


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [(["--max-body-bytes", "0"], {}, "--max-body-bytes"),
     ([], {"KVXFERD_BODY_TIMEOUT_S": "-1"}, "KVXFERD_BODY_TIMEOUT_S"),
     ([], {"KVXFERD_HEADER_TIMEOUT_S": "soon"}, "KVXFERD_HEADER_TIMEOUT_S")],
)  # fmt: skip
def test_a_limit_that_is_not_positive_is_a_config_error_naming_its_source(argv, env, names):
    with pytest.raises(ConfigError, match=names):
        _limits(argv, env)


@pytest.mark.parametrize(
    ("flags", "line"),
    [(["--log-level", "warn"], "--log-level: unknown level 'warn'"),
     (["--timeout", "nan"], "--timeout: must be > 0 and finite, got nan"),
     (["--generation-timeout", "inf"], "--generation-timeout: must be > 0 and finite, got inf"),
     (["--body-timeout", "nan"], "--body-timeout: must be > 0 and finite, got nan"),
     (["--prefill", "http://[::1"], "--prefill: 'http://[::1' is not a valid URL")],
    ids=["log-level", "timeout-nan", "timeout-inf", "limit-nan", "url"],
)  # fmt: skip
def test_a_bad_value_is_one_error_line_before_anything_binds(flags, line) -> None:
    """Each of these was a traceback, or a proxy serving with a wait that never ends."""
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", "http://127.0.0.1:1",
         "--decode", "http://127.0.0.1:1", "--port", "0", *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [error] = done.stderr.splitlines()
    assert error.startswith(f"kvxferd: error: {line}"), error
    assert done.stdout == ""


def test_a_bad_limit_flag_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", "http://127.0.0.1:1",
         "--decode", "http://127.0.0.1:1", "--port", "0", "--max-connections", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--max-connections: must be > 0 and finite, got 0" in done.stderr
