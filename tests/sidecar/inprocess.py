"""An in-process Sidecar beside an engine pool in POSIX shm (its self-test READ over NIXL
loopback), driven directly on one event loop: for tests whose interleavings HTTP cannot pin."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.config import Config
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import ClaimRequest, ClaimResponse, RegisterRequest, Ticket
from tests.sidecar.harness import TOKEN, EnginePool, plan

Scenario = Callable[[Sidecar, RegisterRequest], Awaitable[None]]


def run_in_process(scenario: Scenario, *, engine_id: str, **config: Any) -> None:
    """Run ``scenario(sidecar, register)``, ``register`` naming a llama-3.1-8b pool of 8 blocks;
    the sidecar is closed and the pool unmapped on the way out, whatever happens."""
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    sidecar = Sidecar(Config(peer_token=TOKEN, engine_id=engine_id, **config))
    sidecar.peer_address = "127.0.0.1:9"

    async def main() -> None:
        try:
            await scenario(sidecar, RegisterRequest(manifest=manifest, regions=pool.specs()))
        finally:
            await sidecar.close()

    try:
        asyncio.run(main())
    finally:
        pool.close()


def chosen_ticket(sidecar: Sidecar, generation: int, hold_id: str = "chosen-1") -> Ticket:
    """A ticket the engine's scheduler minted for hold ``hold_id`` (request r1, block 5 of the
    one group, 16 tokens) of ``generation``, before any hold has that id."""
    return sign_ticket(Ticket(
        engine_id=sidecar.engine_id, epoch=sidecar.epoch, hold_id=hold_id, request_id="r1",
        block_ids=[[5]], num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=1,
        peer=sidecar.peer_address, generation=generation,
    ), TOKEN.encode())  # fmt: skip


async def waiting_claim(sidecar: Sidecar, ticket: Ticket) -> asyncio.Task[ClaimResponse]:
    """A decode's claim of ``ticket`` (reader d0, 5 s), once it waits for its hold to be placed."""
    claim = asyncio.create_task(sidecar.claim(
        ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
    ))  # fmt: skip
    async with asyncio.timeout(10):
        while len(sidecar._placements) == 0:
            await asyncio.sleep(0.01)
    return claim
