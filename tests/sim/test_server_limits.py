"""Limits at the edge of a real ``kvxferd sim`` (its OpenAI port): a stalled body is answered
within the body timeout, an oversized one refused before it is read, connections past the cap
closed at once, deeply nested JSON a 4xx; requests within the limits are still served."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.proxy.edge import (
    TEST_LIMITS,
    check_flood,
    check_nested,
    check_oversized_announced,
    check_stalled_body,
)
from tests.sim.procs import PATHS, Sim, start_sims, text_of

MODEL = "granite-4.0-h-tiny"


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[Sim, int]]:
    """A colocated sim (no sidecar needed for its HTTP edge) with small limits."""
    sims = start_sims({"colocated": ["--role", "colocated", "--config", MODEL,
                                     "--pool-blocks", "30", *TEST_LIMITS]})  # fmt: skip
    one = sims["colocated"]
    try:
        yield one, int(one.url.rsplit(":", 1)[1])
    finally:
        one.child.terminate()
        one.child.stop()


@pytest.mark.parametrize("kind", sorted(PATHS))
def test_a_stalled_body_is_answered_within_the_body_timeout(sim, kind):
    check_stalled_body(sim[1], PATHS[kind])


@pytest.mark.parametrize("kind", sorted(PATHS))
def test_a_body_announced_above_the_limit_is_413_before_it_is_read(sim, kind):
    check_oversized_announced(sim[1], PATHS[kind])


def test_connections_past_the_cap_are_closed_and_service_resumes(sim):
    check_flood(sim[1], sim[0].url)


@pytest.mark.parametrize("depth", [1000, 20000])
@pytest.mark.parametrize("kind", sorted(PATHS))
def test_json_nested_deeply_is_a_4xx(sim, kind, depth):
    check_nested(sim[0].url, PATHS[kind], depth)


def test_requests_within_the_limits_are_served(sim):
    resp = sim[0].post(PATHS["completion"], {"prompt": "w " * 2000, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    assert text_of("completion", resp)
