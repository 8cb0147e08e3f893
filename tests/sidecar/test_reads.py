"""Reads never abandon a READ: cancelled mid-post or mid-wait, ``read`` ends only once the
transfer is terminal (or its peer was cut off) and released; each peer has bounded slots.

The agent is a scripted stand-in (pure bookkeeping); the real thing is exercised against NIXL in
test_fail_closed_e2e.py and test_isolation_e2e.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvxferd.errors import UnsettledReadError
from kvxferd.sidecar import reads as reads_mod
from kvxferd.sidecar.reads import Reads, run_to_end
from kvxferd.transport import Transfer, TransferState


class _Nixl:
    def __init__(self) -> None:
        self.finish = False

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE" if self.finish else "PROC"


class _Handle:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


class _Agent:
    """``read`` posts a scripted Transfer; with ``gate`` set it first blocks until released."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.entered = threading.Event()  # a post has started
        self.nixl = _Nixl()
        self.transfers: list[Transfer] = []
        self.live = 0

    def read(self, remote: str, local: object, remote_descs: object, notif: bytes) -> Transfer:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        handle = _Handle()
        xfer = Transfer(self.nixl, handle, remote=remote, nbytes=1, descriptors=1,
                        capture_telemetry=False, on_release=self._released)  # fmt: skip
        xfer.handle = handle  # type: ignore[attr-defined]
        xfer._post()
        self.transfers.append(xfer)
        self.live += 1
        return xfer

    def _released(self, _: Transfer) -> None:
        self.live -= 1


def _read(reads: Reads, big: bool, deadline_in: float = 30.0, address: str = "p:1",
          on_ended=None):  # noqa: ANN001 # fmt: skip
    loop = asyncio.get_running_loop()
    size = reads_mod.INLINE_BYTES + 1 if big else 1
    return reads.read(address, "peer", None, None, b"n", nbytes=size, descs=1,
                      deadline=loop.time() + deadline_in, on_ended=on_ended)  # fmt: skip


def test_cancelled_mid_post_the_read_ends_only_after_the_post_and_its_settling():
    gate = threading.Event()
    agent = _Agent(gate)

    async def main() -> None:
        reads = Reads(agent, on_stuck=_never)  # type: ignore[arg-type]
        task = asyncio.create_task(_read(reads, big=True))
        assert await asyncio.to_thread(agent.entered.wait, 30)  # in the post thread: cancel
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for the post it cannot abandon
        gate.set()
        await asyncio.sleep(0.05)
        assert not task.done()  # posted: now waiting for the transfer to be terminal
        assert agent.live == 1
        agent.nixl.finish = True
        with pytest.raises(asyncio.CancelledError):
            await task
        assert agent.live == 0 and agent.transfers[0].handle.released
        await reads.close()

    asyncio.run(main())


def test_cancelled_mid_wait_the_transfer_is_settled_before_the_cancellation_surfaces():
    agent = _Agent()

    async def main() -> None:
        reads = Reads(agent, on_stuck=_never)  # type: ignore[arg-type]
        task = asyncio.create_task(_read(reads, big=False))
        await _until(lambda: reads.poller.waiting == 1)  # posted, waiting: cancel
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done() and agent.live == 1
        agent.nixl.finish = True
        with pytest.raises(asyncio.CancelledError):
            await task
        assert agent.transfers[0].state is TransferState.DONE and agent.live == 0
        await reads.close()

    asyncio.run(main())


def test_a_read_that_does_not_settle_is_reported_unsettled_kept_and_reported_when_it_ends(
    monkeypatch,
):
    monkeypatch.setattr(reads_mod, "SETTLE_S", 0.05)
    monkeypatch.setattr(reads_mod, "QUARANTINE_POLL_S", 0.001)
    agent = _Agent()
    ended: list[int] = []  # the live handles as on_ended was called

    async def main() -> None:
        reads = Reads(agent, on_stuck=_never)  # type: ignore[arg-type]
        with pytest.raises(UnsettledReadError, match="may still change"):
            await _read(reads, big=False, deadline_in=0.01,
                        on_ended=lambda: ended.append(agent.live))  # fmt: skip
        # Not released: a handle that may still write stays counted (quarantined).
        assert reads.unsettled == 1 and agent.live == 1 and ended == []
        agent.nixl.finish = True  # it ends on its own (the peer resumed)
        await _until(lambda: agent.live == 0)
        assert agent.transfers[0].state is TransferState.DONE
        assert ended == [0]  # once, when it was terminal and released: its memory is free
        await reads.close()

    asyncio.run(main())


def test_a_quarantined_read_that_never_ends_is_given_up_with_its_peer_and_not_reported_ended(
    monkeypatch,
):
    monkeypatch.setattr(reads_mod, "SETTLE_S", 0.01)
    monkeypatch.setattr(reads_mod, "QUARANTINE_S", 0.05)
    monkeypatch.setattr(reads_mod, "QUARANTINE_POLL_S", 0.001)
    agent = _Agent()
    cut: list[str] = []
    ended: list[str] = []

    async def on_stuck(address: str) -> None:
        cut.append(address)

    async def main() -> None:
        reads = Reads(agent, on_stuck=on_stuck)  # type: ignore[arg-type]
        with pytest.raises(UnsettledReadError):
            await _read(reads, big=False, deadline_in=0.01, address="frozen:1",
                        on_ended=lambda: ended.append("ended"))  # fmt: skip
        await _until(lambda: agent.live == 0 and reads.quarantined == 0)
        assert cut == ["frozen:1"]
        assert ended == []  # it may still write: never reported ended
        await reads.close()

    asyncio.run(main())


def test_a_quarantined_read_still_in_flight_at_close_is_not_reported_ended(monkeypatch):
    monkeypatch.setattr(reads_mod, "SETTLE_S", 0.01)
    agent = _Agent()
    ended: list[str] = []

    async def main() -> None:
        reads = Reads(agent, on_stuck=_never)  # type: ignore[arg-type]
        with pytest.raises(UnsettledReadError):
            await _read(reads, big=False, deadline_in=0.01,
                        on_ended=lambda: ended.append("ended"))  # fmt: skip
        assert reads.quarantined == 1
        await reads.close()
        assert reads.quarantined == 0 and agent.live == 0
        assert ended == []  # released in flight, it may still write: never reported ended

    asyncio.run(main())


def test_each_peer_has_bounded_slots_and_other_peers_are_not_queued_behind_it():
    agent = _Agent()

    async def main() -> None:
        reads = Reads(agent, on_stuck=_never, per_peer=2)  # type: ignore[arg-type]
        slow = [asyncio.create_task(_read(reads, big=False, address="slow:1")) for _ in range(3)]
        await _until(lambda: reads.poller.waiting == 2)
        other = asyncio.create_task(_read(reads, big=False, address="fast:1"))
        await _until(lambda: reads.poller.waiting == 3)  # fast:1 did not queue behind slow:1
        assert len(agent.transfers) == 3  # the third of slow:1 still waits for a slot
        agent.nixl.finish = True
        await asyncio.gather(*slow, other)
        assert len(agent.transfers) == 4 and agent.live == 0
        assert reads._slots == {}  # the table only holds peers in use
        await reads.close()

    asyncio.run(main())


def test_run_to_end_passes_the_result_or_the_error_when_not_cancelled():
    async def ok() -> int:
        return 7

    async def bad() -> None:
        raise ValueError("x")

    async def main() -> None:
        assert await run_to_end(ok()) == 7
        with pytest.raises(ValueError, match="x"):
            await run_to_end(bad())

    asyncio.run(main())


async def _until(predicate, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    """Yield to the loop until ``predicate()`` holds (bounded)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)


async def _never(address: str) -> None:
    raise AssertionError(f"{address} cut off")
