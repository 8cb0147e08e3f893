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

from kvxferd.config import Config
from kvxferd.errors import DuplicateHoldError, UnknownHoldError
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import AbortHoldRequest, ClaimRequest, HoldRequest, RegisterRequest, Ticket
from tests.sidecar.harness import TOKEN, EnginePool, plan

pytestmark = pytest.mark.nixl


def test_a_hold_given_up_before_it_was_placed_is_never_placed_nor_claimed():
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    sidecar = Sidecar(Config(peer_token=TOKEN, engine_id="late-hold", hold_grace_s=60))
    sidecar.peer_address = "127.0.0.1:9"

    async def scenario() -> None:
        try:
            await abort_before_hold()
        finally:
            await sidecar.close()

    async def abort_before_hold() -> None:
        reg = await sidecar.register(RegisterRequest(manifest=manifest, regions=pool.specs()))
        ticket = sign_ticket(Ticket(
            engine_id=sidecar.engine_id, epoch=sidecar.epoch, hold_id="chosen-1",
            request_id="r1", block_ids=[[5]], num_tokens=16, expires_at=0.0, tp_rank=0,
            tp_size=1, peer=sidecar.peer_address, generation=reg.generation,
        ), TOKEN.encode())  # fmt: skip
        claim = asyncio.create_task(sidecar.claim(
            ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
        ))  # fmt: skip
        async with asyncio.timeout(10):  # the claim waits (up to 60 s) for "chosen-1"
            while len(sidecar._placements) == 0:
                await asyncio.sleep(0.01)
        with pytest.raises(UnknownHoldError, match="given up"):
            sidecar.abort(AbortHoldRequest(hold_id="chosen-1"))
        with pytest.raises(UnknownHoldError, match="given up"):
            await asyncio.wait_for(claim, 10)  # woken by the abort, not the 60 s grace
        with pytest.raises(DuplicateHoldError, match="given up before it was placed"):
            sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16,
                                     hold_id="chosen-1"))  # fmt: skip
        holds = sidecar.holds
        assert holds is not None and len(holds) == 0 and holds.released_since(0).holds == []

    try:
        asyncio.run(scenario())
    finally:
        pool.close()
