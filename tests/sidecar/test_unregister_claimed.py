"""An unregister waits for the claimed holds it gave up and for the store's copies together. A
claimed hold whose reader notifies only after the hold wait gave up, while the store wait still
runs, is released by then: the unregister goes on (nothing reads the memory any more) instead
of failing on the holds it counted before.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly on
one event loop; the store's stop is stood in for, so the notification lands after the hold
wait ended and before the store wait does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvxferd.sidecar import service
from kvxferd.sidecar.service import Sidecar
from kvxferd.wire import HoldRequest, RegisterRequest, UnregisterRequest
from tests.sidecar.inprocess import run_in_process

pytestmark = pytest.mark.nixl


def test_a_claimed_hold_read_while_the_store_copies_still_run_lets_the_unregister_finish(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(service, "STOP_S", 0.2)  # the hold wait gives up after 0.2 s

    async def read_after_the_hold_wait(sidecar: Sidecar, register: RegisterRequest) -> None:
        reg = await sidecar.register(register)
        ticket = sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16))
        holds = sidecar.holds
        assert holds is not None
        holds.claim(ticket.hold_id, "d0", 60.0, block_ids=[[5]], reader_tp_size=1)

        until_read, hold_wait_over = service.wait_while, asyncio.Event()

        async def hold_wait(busy: Callable[[], bool], changed: asyncio.Event,
                            timeout_s: float) -> None:  # fmt: skip
            await until_read(busy, changed, timeout_s)
            hold_wait_over.set()

        async def store_copies_end_late(timeout_s: float) -> int:
            await asyncio.wait_for(hold_wait_over.wait(), 10)
            holds.notify(ticket.hold_id, "d0")  # the reader is done meanwhile
            return 0

        monkeypatch.setattr(service, "wait_while", hold_wait)  # the wait for read holds
        monkeypatch.setattr(sidecar.offload, "stop", store_copies_end_late)
        try:
            await asyncio.wait_for(
                sidecar.unregister(UnregisterRequest(generation=reg.generation)), 30
            )
        finally:
            monkeypatch.undo()
        assert sidecar.manifest is None and sidecar.generation == -1
        assert [(h.hold_id, h.reason) for h in holds.released_since(0).holds] == [
            (ticket.hold_id, "unregistered")
        ]

    run_in_process(read_after_the_hold_wait, engine_id="unreg-claimed")
