"""A claim that comes before its engine-chosen hold waits for the placement, bounded in time and
in how many hold ids are waited for at once, and leaves nothing behind."""

from __future__ import annotations

import asyncio

from kvxferd.sidecar.placements import Placements


def test_a_claim_waiting_for_its_hold_wakes_when_it_is_placed():
    async def main() -> None:
        placements = Placements()
        waiting = [asyncio.create_task(placements.wait("h1", 60.0)) for _ in range(2)]
        while len(placements) == 0:
            await asyncio.sleep(0)  # let the waiters register
        placements.placed("h2")  # another hold: nobody wakes
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)
        placements.placed("h1")
        await asyncio.wait_for(asyncio.gather(*waiting), 10.0)
        assert len(placements) == 0

    asyncio.run(main())


def test_a_wait_ends_after_its_grace_and_beyond_the_bound_at_once():
    async def main() -> None:
        placements = Placements(max_waiting=1)
        first = asyncio.create_task(placements.wait("h1", 60.0))
        while len(placements) == 0:
            await asyncio.sleep(0)
        await asyncio.wait_for(placements.wait("h2", 60.0), 10.0)  # over the bound: at once
        await asyncio.wait_for(placements.wait("h1", 0.01), 10.0)  # same id: its own grace
        assert len(placements) == 1 and not first.done()
        placements.placed("h1")
        await asyncio.wait_for(first, 10.0)
        assert len(placements) == 0

    asyncio.run(main())
