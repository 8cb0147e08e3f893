"""The simulated decode's declines reach the sidecar in a form it takes: whatever the reason's
text (a failed pull's reason carries a peer's error detail, up to a thousand characters, with
its line breaks escaped or not), the decline carries it on one line, cut to the wire's bound, so
the prefill's holds are released now instead of at lease expiry."""

from __future__ import annotations

import asyncio
import re

import msgspec

from kvxferd.errors import KvxferdError
from kvxferd.sim.engine import EngineSettings, SimEngine
from kvxferd.sim.kvpool import RankPool
from kvxferd.wire import (
    DECLINE_REASON_MAX_LENGTH,
    ONE_LINE_PATTERN,
    DeclineRequest,
    DeclineResponse,
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
