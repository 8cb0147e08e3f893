"""The staging buffer: registered once on first demand, bounded, pages handed out contiguously
and back; pages under an unsettled READ are not handed out again until it ended (or ever, when
it was given up); closing deregisters.

A real NIXL agent (in process) registers the buffer; leases are pure bookkeeping over it. A
large scatter runs on the pool's thread and is awaited to its end, even when cancelled.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import threading

import numpy as np
import pytest

from kvxferd.descriptors import ReadPlan, stage_plans
from kvxferd.sidecar import staging as staging_mod
from kvxferd.sidecar.reads import INLINE_BYTES
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
        assert (pool.retired, pool.retired_bytes) == (1, PAGE)  # kvxferd_staging_retired_bytes
        got = [pool.acquire(PAGE) for _ in range(2)]
        assert got[0] is not None and got[0].first == 1 and got[1] is None
        pool.release(got[0])
        await pool.close()  # deregistered; the mapping stays (a late write lands in it)
        assert agent.live_handles().registrations == 0
        assert pool.retired_bytes == 0  # the next buffer starts with none retired
        again = await _opened(pool, 2 * PAGE)  # a fresh buffer, all of it free
        assert again.pages == 2
        pool.release(again)
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))


def test_retired_pages_come_back_once_their_read_ended_and_the_gauge_follows():
    async def main(agent: Agent) -> None:
        gauge: list[int] = []  # kvxferd_staging_retired_bytes, as told
        pool = StagingPool(agent, 2 * PAGE, on_retired=gauge.append)
        a = await _opened(pool, 2 * PAGE)
        pool.retire(a)  # its READ may still write: no room for anyone
        assert pool.acquire(PAGE) is None and gauge == [2 * PAGE]
        pool.restore(a)  # the quarantined READ ended: it can no longer write
        assert (pool.retired, gauge) == (0, [2 * PAGE, 0])
        b = pool.acquire(2 * PAGE)
        assert b is not None and b.first == 0
        pool.restore(b)  # ended before its pull retired it (the quarantine polled first)
        pool.retire(b)  # released instead: never retired
        assert pool.retired == 0 and gauge == [2 * PAGE, 0]
        c = pool.acquire(2 * PAGE)
        assert c is not None
        pool.retire(c)
        await pool.close()  # its READ given up meanwhile: the pool starts afresh
        assert gauge[-1] == 0
        d = await _opened(pool, PAGE)
        pool.restore(c)  # a lease of the buffer before: nothing of the new one is touched
        assert pool.acquire(2 * PAGE) is None  # d still holds its page
        pool.release(d)
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


async def _given_up(pool: StagingPool, nbytes: int) -> None:
    """The first acquire starts the buffer's opening; wait (bounded) until it ended."""
    assert pool.acquire(nbytes) is None
    opening = pool._opening
    assert opening is not None
    async with asyncio.timeout(10):
        await asyncio.wait({opening})


def test_a_buffer_the_transport_refuses_is_warned_once_and_pulls_read_direct(caplog):
    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 2 * PAGE)
        agent.close()  # registering now fails (TransportError)
        await _given_up(pool, PAGE)
        assert "no staging buffer (pulls read direct)" in caplog.text
        assert [pool.acquire(PAGE) for _ in range(3)] == [None] * 3  # never retried
        assert pool._opening is not None and pool._opening.done()
        await pool.close()

    agent = Agent("staging-test", progress_thread=False)
    try:
        asyncio.run(main(agent))
    finally:
        agent.close()


def test_a_buffer_the_host_cannot_map_is_warned_and_pulls_read_direct(caplog):
    """``--staging-bytes`` is accepted up to 1 TiB; a host that cannot map that much (no
    overcommit of it) leaves the sidecar without a staging buffer, said so, not failing."""
    size = 1 << 40
    try:
        mmap.mmap(-1, size).close()
        pytest.skip("this host maps 1 TiB of anonymous memory")
    except OSError:
        pass

    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, size)
        await _given_up(pool, PAGE)
        assert "no staging buffer (pulls read direct)" in caplog.text
        assert pool._opening is not None and pool._opening.exception() is None
        assert pool.acquire(PAGE) is None
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))


def _large_plan():
    """64 rows of 80 KiB, one contiguous remote run (5 MiB: a threaded scatter), written to the
    local region in reverse order."""
    rows, n = 64, 80 << 10
    idx = np.arange(rows, dtype=np.int64)
    z = np.zeros(rows, dtype=np.int64)
    plan = ReadPlan(z, (rows - 1 - idx) * n, z, idx * n, np.full(rows, n, dtype=np.int64),
                    rows * n, 0)  # fmt: skip
    staged = stage_plans(
        [plan], [1], min_descriptors=1, max_bytes=1 << 30, max_copy_per_saved=math.inf
    )  # the pool's threaded copy, not the rule
    assert staged is not None and staged.nbytes > INLINE_BYTES
    return plan, staged


def test_a_large_scatter_is_copied_whole_off_the_loop():
    plan, staged = _large_plan()

    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 8 << 20)
        lease = await _opened(pool, staged.nbytes)
        lease.view[: staged.nbytes] = np.random.default_rng(3).integers(
            0, 256, staged.nbytes, dtype=np.uint8
        )
        want = np.zeros(plan.total_bytes, dtype=np.uint8)
        for lo, ro, n in zip(plan.local_offset.tolist(), plan.remote_offset.tolist(),
                             plan.length.tolist(), strict=True):  # fmt: skip
            want[lo : lo + n] = lease.view[ro : ro + n]  # one run from 0: staging = remote
        local = np.zeros(plan.total_bytes, dtype=np.uint8)
        await pool.scatter(lease, [local], staged)
        np.testing.assert_array_equal(local, want)
        pool.release(lease)
        await pool.close()
        assert agent.live_handles().registrations == 0

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))


def test_a_cancelled_pull_is_told_only_once_its_threaded_scatter_ended(monkeypatch):
    _, staged = _large_plan()
    gate, ended = threading.Event(), threading.Event()

    def held(stage, views, plan) -> None:  # noqa: ANN001 - the copy, held until the gate opens
        gate.wait(30)
        ended.set()

    monkeypatch.setattr(staging_mod, "scatter", held)

    async def main(agent: Agent) -> None:
        pool = StagingPool(agent, 8 << 20)
        lease = await _opened(pool, staged.nbytes)
        task = asyncio.create_task(pool.scatter(lease, [np.zeros(1, dtype=np.uint8)], staged))
        await asyncio.sleep(0)  # on the pool's thread now
        task.cancel()
        for _ in range(50):  # loop turns in which a cancellation would have been delivered
            await asyncio.sleep(0)
        assert not task.done()  # still waiting: the copy may still write
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()
        pool.release(lease)
        await pool.close()

    with Agent("staging-test", progress_thread=False) as agent:
        asyncio.run(main(agent))
