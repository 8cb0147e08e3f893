"""Lanes hand out a few small httpx clients in turn, made on first use and sharing one SSL
context, so many requests in flight never pile into one connection pool."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvxferd.lanes import Lanes, ssl_context


def test_clients_are_made_on_first_use_and_handed_out_round_robin():
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    lanes = Lanes(make, 3)  # type: ignore[type-var]
    assert len(lanes) == 3 and lanes.made() == [] and made == []
    got = [lanes.next() for _ in range(7)]
    assert len(made) == 3
    assert got == [made[0], made[1], made[2], made[0], made[1], made[2], made[0]]
    assert lanes.made() == made


def test_at_least_one_lane():
    with pytest.raises(ValueError, match="at least 1"):
        Lanes(httpx.Client, 0)


def test_every_lane_shares_one_ssl_context():
    assert ssl_context() is ssl_context()
    assert ssl_context().verify_mode.name == "CERT_REQUIRED"


def test_concurrent_requests_spread_over_the_lanes():
    seen: list[int] = []

    async def scenario() -> None:
        clients: list[httpx.AsyncClient] = []

        def make() -> httpx.AsyncClient:
            i = len(clients)

            def handler(request: httpx.Request) -> httpx.Response:
                seen.append(i)
                return httpx.Response(200)

            clients.append(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
            return clients[-1]

        lanes = Lanes(make, 4)
        await asyncio.gather(*(lanes.next().get("http://x/") for _ in range(16)))
        for c in lanes.made():
            await c.aclose()

    asyncio.run(scenario())
    assert sorted(seen) == sorted([0, 1, 2, 3] * 4)
