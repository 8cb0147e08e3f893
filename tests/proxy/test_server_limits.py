"""Limits at the edge of a real ``kvxferd proxy``: a stalled body is answered within the body
timeout, an oversized one refused before it is read, connections past the cap closed at once,
deeply nested JSON a 4xx; requests within the limits still go through."""

from __future__ import annotations

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
from tests.proxy.fakes import FakeBackend, fake_app, proxy_process, serve_app

PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[str, int]]:
    """A proxy with small limits in front of fake backends: (url, port)."""
    prefill = serve_app(fake_app(FakeBackend("P0", "prefill")))
    decode = serve_app(fake_app(FakeBackend("D0", "decode")))
    try:
        with proxy_process("--prefill", prefill.url, "--decode", decode.url, "--port", "0",
                           *TEST_LIMITS) as (_proc, url):  # fmt: skip
            yield url, int(url.rsplit(":", 1)[1])
    finally:
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
