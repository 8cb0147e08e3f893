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

from kvxferd.config import Config
from kvxferd.errors import UnknownHoldError
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.states import HoldState
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    AbortHoldRequest,
    ClaimRequest,
    HoldRequest,
    RegisterRequest,
    Ticket,
    UnregisterRequest,
)
from tests.sidecar.harness import TOKEN, EnginePool, plan

pytestmark = pytest.mark.nixl


def test_a_claim_that_waited_across_a_re_registration_is_refused_and_pins_nothing():
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    sidecar = Sidecar(Config(peer_token=TOKEN, engine_id="gen-test", hold_grace_s=60))
    sidecar.peer_address = "127.0.0.1:9"
    register = RegisterRequest(manifest=manifest, regions=pool.specs())

    async def scenario() -> None:
        try:
            await claim_across_re_registration()
        finally:
            await sidecar.close()

    async def claim_across_re_registration() -> None:
        first = await sidecar.register(register)
        ticket = sign_ticket(Ticket(
            engine_id=sidecar.engine_id, epoch=sidecar.epoch, hold_id="chosen-1",
            request_id="r1", block_ids=[[5]], num_tokens=16, expires_at=0.0, tp_rank=0,
            tp_size=1, peer=sidecar.peer_address, generation=first.generation,
        ), TOKEN.encode())  # fmt: skip
        claim = asyncio.create_task(sidecar.claim(
            ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
        ))  # fmt: skip
        async with asyncio.timeout(10):  # the claim waits for hold "chosen-1" to be placed
            while len(sidecar._placements) == 0:
                await asyncio.sleep(0.01)
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

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
