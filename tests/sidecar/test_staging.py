"""The staging buffer: registered once on first demand, bounded, pages handed out contiguously
and back; pages under an unsettled READ are never handed out again; closing deregisters.

A real NIXL agent (in process) registers the buffer; leases are pure bookkeeping over it.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.sidecar.staging import PAGE, StagingPool
from kvxferd.transport import Agent

pytestmark = pytest.mark.nixl


async def _opened(pool: StagingPool, nbytes: int):
    """The first acquire starts the registration and reads direct (None); wait (bounded)."""
    assert pool.acquire(nbytes) is None
    for _ in range(1000):
        lease = pool.acquire(nbytes)
        if lease is not None:
            return lease
        await asyncio.sleep(0.01)
    raise AssertionError("the staging buffer was not registered in 10 s")


def test_leases_are_contiguous_bounded_and_come_back():
    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 4 * PAGE)
        a = await _opened(pool, PAGE + 1)  # two pages
        assert agent.live_handles().registrations == 1
        b = pool.acquire(2 * PAGE)
        assert (a.first, a.pages, b.first, b.pages) == (0, 2, 2, 2)
        assert b.addr == a.addr + 2 * PAGE and len(b.view) == 2 * PAGE
        assert pool.acquire(1) is None  # full: that pull reads direct
        assert pool.no_room == 1
        pool.release(a)
        assert pool.acquire(3 * PAGE) is None  # two free pages, not three
        c = pool.acquire(2 * PAGE)
        assert c.first == 0
        pool.release(b)
        pool.release(c)
        assert pool.acquire(5 * PAGE) is None  # larger than the buffer: never staged
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))


def test_pages_of_an_unsettled_read_are_never_handed_out_again():
    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 2 * PAGE)
        a = await _opened(pool, PAGE)
        b = pool.acquire(PAGE)
        pool.retire(a)  # its READ may still write these pages
        pool.release(b)
        assert pool.retired == 1
        got = [pool.acquire(PAGE) for _ in range(2)]
        assert got[0] is not None and got[0].first == 1 and got[1] is None
        pool.release(got[0])
        await pool.close()  # deregistered; the mapping stays (a late write lands in it)
        assert agent.live_handles().registrations == 0
        again = await _opened(pool, 2 * PAGE)  # a fresh buffer, all of it free
        assert again.pages == 2
        pool.release(again)
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))


def test_a_pool_of_zero_bytes_never_stages_nor_registers():
    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 0)
        assert not pool.enabled and pool.acquire(1) is None
        await asyncio.sleep(0)
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))
