"""CompletionPoller: transfers complete on the event loop, one stalled transfer delays no other.

Scripted NIXL stand-ins check the bookkeeping; the last test waits for a real READ over UCX.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kvxferd.errors import TransferFailedError, TransferTimeoutError
from kvxferd.transport import Agent, Transfer, TransferState
from kvxferd.transport.completion import CompletionPoller
from tests.transport.conftest import SENTINEL


class _Nixl:
    """check_xfer_state answers PROC until ``finish`` is set, then ``outcome``; records threads."""

    def __init__(self, outcome: str = "DONE") -> None:
        self.finish = False
        self.outcome = outcome
        self.threads: set[int] = set()
        self.checks = 0

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        self.threads.add(threading.get_ident())
        self.checks += 1
        return self.outcome if self.finish else "PROC"


class _Handle:
    def release(self) -> None:
        pass


def _transfer(nixl: _Nixl) -> Transfer:
    xfer = Transfer(nixl, _Handle(), remote="peer", nbytes=64, descriptors=1,
                    capture_telemetry=False, on_release=lambda _: None)  # fmt: skip
    xfer._post()
    return xfer


def test_a_transfer_completes_on_the_loop_thread_without_a_worker_thread():
    nixl = _Nixl()
    xfer = _transfer(nixl)

    async def main() -> TransferState:
        poller = CompletionPoller()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, setattr, nixl, "finish", True)
        state = await poller.wait(xfer, loop.time() + 10)
        assert poller.waiting == 0
        await poller.close()
        return state

    assert asyncio.run(main()) is TransferState.DONE
    assert nixl.threads == {threading.get_ident()}  # every poll ran on the loop's own thread


def test_a_failed_transfer_raises_its_typed_error():
    nixl = _Nixl(outcome="ERR")
    xfer = _transfer(nixl)
    nixl.finish = True

    async def main() -> None:
        await CompletionPoller().wait(xfer, asyncio.get_running_loop().time() + 10)

    with pytest.raises(TransferFailedError, match="ERR"):
        asyncio.run(main())


def test_the_deadline_raises_a_timeout_and_leaves_the_transfer_posted():
    xfer = _transfer(_Nixl())

    async def main() -> None:
        poller = CompletionPoller()
        try:
            await poller.wait(xfer, asyncio.get_running_loop().time() + 0.01)
        finally:
            assert poller.waiting == 0  # the waiter is gone, the transfer is the caller's
            await poller.close()

    with pytest.raises(TransferTimeoutError, match="deadline"):
        asyncio.run(main())
    assert xfer.state is TransferState.POSTED


def test_a_kick_ends_the_backoff_sleep_at_once(monkeypatch):
    """With the backoff stretched to a minute, only the kick can make the poller look again
    within the test's bound (a claim's answer kicks it: the READ is likely done by then)."""
    from kvxferd.transport import completion

    monkeypatch.setattr(completion, "FIRST_SLEEP_S", 60.0)
    monkeypatch.setattr(completion, "MAX_SLEEP_S", 60.0)
    nixl = _Nixl()
    xfer = _transfer(nixl)

    async def main() -> TransferState:
        poller = CompletionPoller()
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(poller.wait(xfer, loop.time() + 120))
        while not poller.backing_off:  # spun SPIN_ROUNDS times, now in the minute-long sleep
            await asyncio.sleep(0)
        nixl.finish = True
        poller.kick()
        state = await asyncio.wait_for(waiter, 30)
        await poller.close()
        return state

    assert asyncio.run(main()) is TransferState.DONE


def test_a_new_transfer_is_polled_a_few_times_and_a_kick_spins_again(monkeypatch):
    """A pull's READ completes once its claim is taken: polling it eagerly before the claim's
    answer kicks the poller only takes CPU from the processes it waits on."""
    from kvxferd.transport import completion

    monkeypatch.setattr(completion, "FIRST_SLEEP_S", 60.0)
    monkeypatch.setattr(completion, "MAX_SLEEP_S", 60.0)
    nixl = _Nixl()
    xfer = _transfer(nixl)

    async def main() -> tuple[int, int]:
        poller = CompletionPoller()
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(poller.wait(xfer, loop.time() + 120))
        while not poller.backing_off:
            await asyncio.sleep(0)
        fresh = nixl.checks
        poller.kick()
        await asyncio.sleep(0)
        while not poller.backing_off:
            await asyncio.sleep(0)
        kicked = nixl.checks - fresh
        nixl.finish = True
        poller.kick()
        assert await asyncio.wait_for(waiter, 30) is TransferState.DONE
        await poller.close()
        return fresh, kicked

    fresh, kicked = asyncio.run(main())
    assert fresh <= completion.FRESH_SPIN_ROUNDS + 2  # its first look, then the short spin
    assert fresh < completion.SPIN_ROUNDS  # far fewer looks before the kick than after it
    assert kicked > completion.SPIN_ROUNDS  # the kick's full spin


def test_a_stalled_transfer_does_not_delay_another():
    stalled, healthy = _Nixl(), _Nixl()
    xs, xh = _transfer(stalled), _transfer(healthy)

    async def main() -> None:
        poller = CompletionPoller()
        loop = asyncio.get_running_loop()
        waiters = [asyncio.create_task(poller.wait(xs, loop.time() + 60)) for _ in range(50)]
        loop.call_later(0.01, setattr, healthy, "finish", True)
        assert await poller.wait(xh, loop.time() + 60) is TransferState.DONE
        # Compared, not timed: the healthy one is done while all stalled waiters still wait.
        assert not any(w.done() for w in waiters)
        assert poller.waiting == 1
        stalled.finish = True
        assert set(await asyncio.gather(*waiters)) == {TransferState.DONE}
        await poller.close()

    asyncio.run(main())


def _read_through_poller(agent: Agent, peer, dst, n: int, notif: bytes = b"") -> None:
    """READ the peer's first ``n`` bytes into ``dst`` and await it with a CompletionPoller;
    every byte read must match, and nothing past ``n`` may be written."""
    agent.add_remote(peer.metadata)
    xfer = agent.read(peer.name, np.array([[dst.base_addr, n]]),
                      np.array([[peer.remote_base, n]]), notif)  # fmt: skip

    async def main() -> TransferState:
        poller = CompletionPoller()
        try:
            return await poller.wait(xfer, asyncio.get_running_loop().time() + 60)
        finally:
            await poller.close()

    try:
        assert asyncio.run(main()) is TransferState.DONE
    finally:
        xfer.release()
    got = dst.host_view()
    assert np.array_equal(got[:n], peer.src.host_view()[:n])
    assert (got[n:] == SENTINEL).all()
    assert agent.live_handles().transfers == 0


@pytest.mark.nixl
def test_a_real_read_completes_through_the_poller(agent, peer, dst):
    _read_through_poller(agent, peer, dst, 1 << 20, b"done")


@pytest.mark.nixl
def test_a_real_read_over_tcp_completes_through_the_poller(monkeypatch, dst):
    """UCX over TCP (what pods without RDMA get), the reader without a progress thread: the
    READ moves only in the reader's progress calls, which the poller's rounds are."""
    from tests.transport.conftest import start_peer, unique

    monkeypatch.setenv("UCX_TLS", "tcp")
    peer = start_peer(progress=True)
    agent = Agent(unique("initiator"), progress_thread=False)
    try:
        agent.register(dst)
        _read_through_poller(agent, peer, dst, 3 << 20)
    finally:
        agent.close()
        peer.stop()
        peer.src.close()
