"""An engine's hold call may get no answer (a timeout) and still be on its way when the engine
gives its chosen id up. The abort finds no hold, so the engine frees those blocks at once: the
late hold call must then be refused, and a decode's claim waiting for that id ends at once
instead of binding to blocks about to be reused.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly on
one event loop so the abort lands while the claim waits.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.errors import DuplicateHoldError, UnknownHoldError
from kvxferd.sidecar.service import Sidecar
from kvxferd.wire import AbortHoldRequest, HoldRequest, RegisterRequest
from tests.sidecar.inprocess import chosen_ticket, run_in_process, waiting_claim

pytestmark = pytest.mark.nixl


def test_a_hold_given_up_before_it_was_placed_is_never_placed_nor_claimed():
    async def abort_before_hold(sidecar: Sidecar, register: RegisterRequest) -> None:
        reg = await sidecar.register(register)
        claim = await waiting_claim(sidecar, chosen_ticket(sidecar, reg.generation))
        with pytest.raises(UnknownHoldError, match="given up"):
            sidecar.abort(AbortHoldRequest(hold_id="chosen-1"))
        with pytest.raises(UnknownHoldError, match="given up"):
            await asyncio.wait_for(claim, 10)  # woken by the abort, not the 60 s grace
        with pytest.raises(DuplicateHoldError, match="given up before it was placed"):
            sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16,
                                     hold_id="chosen-1"))  # fmt: skip
        holds = sidecar.holds
        assert holds is not None and len(holds) == 0 and holds.released_since(0).holds == []

    run_in_process(abort_before_hold, engine_id="late-hold", hold_grace_s=60)
