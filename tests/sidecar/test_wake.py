"""Wake: the notification poller's sleep that a claim cuts short (no task per sleep)."""

from __future__ import annotations

import asyncio

from kvxferd.sidecar.wake import Wake


def test_sleep_times_out_false_when_nobody_sets_the_flag():
    async def scenario() -> None:
        wake = Wake()
        assert await wake.sleep(0.001) is False
        assert not wake.is_set()

    asyncio.run(scenario())


def test_set_ends_a_sleep_early_and_stays_set_until_cleared():
    async def scenario() -> None:
        wake = Wake()
        sleeping = asyncio.create_task(wake.sleep(60.0))
        await asyncio.sleep(0)  # the sleeper is waiting now
        wake.set()
        assert await asyncio.wait_for(sleeping, 10.0) is True
        assert await wake.sleep(60.0) is True  # still set: returns at once
        wake.clear()
        assert await wake.sleep(0.001) is False

    asyncio.run(scenario())


def test_a_cancelled_sleep_leaves_the_wake_usable():
    async def scenario() -> None:
        wake = Wake()
        sleeping = asyncio.create_task(wake.sleep(60.0))
        await asyncio.sleep(0)
        sleeping.cancel()
        await asyncio.gather(sleeping, return_exceptions=True)
        assert sleeping.cancelled()
        wake.set()  # no sleeper left to wake: just the flag
        assert await wake.sleep(60.0) is True

    asyncio.run(scenario())
