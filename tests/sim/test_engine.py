"""The simulated decode's declines reach the sidecar in a form it takes: whatever the reason's
text (a failed pull's reason carries a peer's error detail, up to a thousand characters, with
its line breaks escaped or not), the decline carries it on one line, cut to the wire's bound, so
the prefill's holds are released now instead of at lease expiry. A prefill that minted its
tickets and is given up before its holds are placed counts one give-up and frees its blocks.
The sidecars are stand-ins: this is the engine's own bookkeeping."""

from __future__ import annotations

import asyncio
import re

import msgspec

from kvxferd.errors import DuplicateHoldError, KvxferdError, UnknownHoldError
from kvxferd.sim.engine import EngineSettings, Prompt, SimEngine
from kvxferd.sim.kvpool import RankPool
from kvxferd.wire import (
    DECLINE_REASON_MAX_LENGTH,
    ONE_LINE_PATTERN,
    DeclineRequest,
    DeclineResponse,
    HoldRequest,
    Identity,
    Ticket,
)
from tests.sidecar.harness import plan


class _Sidecar:
    """Stands in for rank 0's engine client: decodes each decline as the sidecar does (its
    wire bounds included); one the sidecar would refuse (a 422) raises as the client does."""

    def __init__(self) -> None:
        self.declines: list[DeclineRequest] = []

    async def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        raw = msgspec.json.encode(DeclineRequest(tickets=tickets, reason=reason))
        try:
            self.declines.append(msgspec.json.decode(raw, type=DeclineRequest))
        except msgspec.ValidationError as exc:
            raise KvxferdError(f"422: {exc}") from None
        return DeclineResponse(released=[t.hold_id for t in tickets], missing=[])

    async def aclose(self) -> None:
        return None


def test_a_decline_with_a_long_multiline_reason_is_sent_on_one_line_within_the_bound():
    ticket = Ticket(
        engine_id="p", epoch=1, hold_id="h1", request_id="r1", block_ids=[[1]], num_tokens=16,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9",
    )  # fmt: skip
    reason = "pull failed: rank 0: incompatible: peer said\nforged line\u2028" + "x" * 1000
    sidecar = _Sidecar()
    pool = RankPool(plan("llama-3.1-8b", num_blocks=4))
    try:
        engine = SimEngine(EngineSettings(role="decode", engine_id="d"), [pool], [sidecar])  # type: ignore[list-item]

        async def scenario() -> None:
            engine.decline([ticket], reason)
            await engine.close()  # waits for the background decline

        asyncio.run(scenario())
    finally:
        pool.close()
    assert engine.stats.declines_failed == 0
    (sent,) = sidecar.declines
    assert [t.hold_id for t in sent.tickets] == ["h1"]
    assert len(sent.reason) == DECLINE_REASON_MAX_LENGTH
    assert re.search(ONE_LINE_PATTERN, sent.reason)
    assert sent.reason.startswith("pull failed: rank 0: incompatible: peer said\\nforged line")


class _PlacingSidecar:
    """Rank 0's sidecar as a prefill that mints its tickets meets it: a hold call waits until
    let go; an abort of a hold not placed yet is remembered and refuses that hold call later
    (as the sidecar's HoldTable does)."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.given_up: set[str] = set()

    async def hold(self, req: HoldRequest) -> Ticket:
        await self.go.wait()
        if req.hold_id in self.given_up:
            raise DuplicateHoldError("hold_id", f"{req.hold_id!r} was given up before placed")
        raise AssertionError("a hold given up first must not be placed")

    async def abort(self, hold_id: str) -> None:
        self.given_up.add(hold_id)
        raise UnknownHoldError(f"hold_id {hold_id!r}: no such hold")

    async def aclose(self) -> None:
        return None


def test_a_minted_hold_given_up_before_it_was_placed_counts_once_and_frees_its_blocks():
    """The proxy's release can reach the prefill before the holds it minted are placed: that
    is a give-up (counted, and the blocks come back), not a failed placement (the sim goes on
    minting)."""
    sidecar = _PlacingSidecar()
    pool = RankPool(plan("llama-3.1-8b", num_blocks=8))
    ident = Identity(engine_id="p", epoch=1, generation=5, peer_address="127.0.0.1:9",
                     tp_rank=0, tp_size=1, default_lease_s=30.0)  # fmt: skip
    try:
        engine = SimEngine(EngineSettings(role="prefill", engine_id="p"), [pool], [sidecar],  # type: ignore[list-item]
                           peer="127.0.0.1:9", secret=b"s")  # fmt: skip
        engine.minter._idents = [ident]  # as after its first, held-first request

        async def scenario() -> None:
            prompt = Prompt(tokens=list(range(20)), max_tokens=1, request_id="r1",
                            kv_transfer_params={"do_remote_decode": True})  # fmt: skip
            gen = await engine.generate(prompt)
            assert gen.kv_transfer_params is not None
            assert engine.stats.tickets_minted == 1
            assert engine.blocks.free_count < engine.blocks.total
            assert await engine.give_up(gen.kv_transfer_params) == 1
            sidecar.go.set()
            await asyncio.wait_for(asyncio.gather(*engine._placing), 30)
            await engine.close()

        asyncio.run(scenario())
        s = engine.stats
        assert (s.holds_given_up, s.holds_failed) == (1, 0)
        assert engine.blocks.free_count == engine.blocks.total and not engine._held
        assert engine.minter.ready  # a give-up is no reason to hold first again
    finally:
        pool.close()
