"""Limits at the edge of a real ``kvxferd proxy``: a stalled body is answered within the body
timeout, an oversized one refused before it is read, connections past the cap closed at once,
deeply nested JSON a 4xx; requests within the limits still go through."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.proxy.edge import (
    BOUND_S,
    TEST_LIMITS,
    check_flood,
    check_nested,
    check_oversized_announced,
    check_stalled_body,
)
from tests.proxy.fakes import FakeBackend, fake_app, serve_app

READY_TIMEOUT_S = 60.0
PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, int]]:
    """A proxy with small limits in front of fake backends: (url, port)."""
    prefill = serve_app(fake_app(FakeBackend("P0", "prefill")))
    decode = serve_app(fake_app(FakeBackend("D0", "decode")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxferd", "proxy", "--prefill", prefill.url, "--decode",
         decode.url, "--port", "0", *TEST_LIMITS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)  # type: ignore[union-attr]
    pump.start()
    try:
        line = lines.get(timeout=READY_TIMEOUT_S)
        assert line.startswith("kvxferd proxy ready url="), line
        url = line.split("url=", 1)[1].strip()
        yield url, int(url.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        pump.join(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("path", PATHS)
def test_a_stalled_body_is_answered_within_the_body_timeout(proxy, path):
    check_stalled_body(proxy[1], path)


@pytest.mark.parametrize("path", PATHS)
def test_a_body_announced_above_the_limit_is_413_before_it_is_read(proxy, path):
    check_oversized_announced(proxy[1], path)


def test_connections_past_the_cap_are_closed_and_service_resumes(proxy):
    check_flood(proxy[1], proxy[0])


@pytest.mark.parametrize("depth", [1000, 20000])
def test_json_nested_deeply_is_a_4xx(proxy, depth):
    check_nested(proxy[0], "/v1/chat/completions", depth)


def test_requests_within_the_limits_are_relayed(proxy):
    body = {"model": "m", "prompt": "x" * 30000, "max_tokens": 2}
    resp = httpx.post(proxy[0] + "/v1/completions", json=body, timeout=BOUND_S)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "D0 decoded from P0"
