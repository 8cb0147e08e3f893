"""A claim binds only to a hold of the registration its ticket names, even when it waited for an
engine-chosen hold to be placed: an engine that re-registered meanwhile (sleep and wake) and
places a hold under that id gives it up as stale and frees its blocks at once, so no claim of
the old ticket may bind to it.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly on
one event loop so the re-registration lands while the claim waits.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.errors import UnknownHoldError
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.states import HoldState
from kvxferd.wire import (
    AbortHoldRequest,
    HoldRequest,
    RegisterRequest,
    UnregisterRequest,
)
from tests.sidecar.inprocess import chosen_ticket, run_in_process, waiting_claim

pytestmark = pytest.mark.nixl


def test_a_claim_that_waited_across_a_re_registration_is_refused_and_pins_nothing():
    async def claim_across_re_registration(sidecar: Sidecar, register: RegisterRequest) -> None:
        first = await sidecar.register(register)
        claim = await waiting_claim(sidecar, chosen_ticket(sidecar, first.generation))
        await sidecar.unregister(UnregisterRequest(generation=first.generation))
        second = await sidecar.register(register)
        assert second.generation == first.generation + 1
        sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16,
                                 hold_id="chosen-1"))  # fmt: skip
        with pytest.raises(UnknownHoldError, match="re-registered"):
            await asyncio.wait_for(claim, 10)
        holds = sidecar.holds
        assert holds is not None
        assert holds.get("chosen-1").state is HoldState.HELD  # nobody claimed it
        # So the engine's abort of it as stale releases it at once: its blocks may be freed.
        sidecar.abort(AbortHoldRequest(hold_id="chosen-1"))
        assert [(h.hold_id, h.reason) for h in holds.released_since(0).holds] == [
            ("chosen-1", "aborted")
        ]

    run_in_process(claim_across_re_registration, engine_id="gen-test", hold_grace_s=60)
