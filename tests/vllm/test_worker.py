"""The worker side's declines: a step's declines go to the sidecar in calls of at most
MAX_TICKETS_PER_CALL tickets (the sidecar refuses a longer list), every ticket once, in order,
and a call that fails does not keep the others from being sent."""

from __future__ import annotations

import msgspec

from kvxferd.errors import HandshakeError
from kvxferd.vllm.scheduler import Decline, StepOrders
from kvxferd.vllm.worker import WorkerSide
from kvxferd.wire import MAX_TICKETS_PER_CALL, DeclineRequest, DeclineResponse, Ticket


class _Sidecar:
    """Stands in for the engine client: decodes each decline as the sidecar would (its wire
    bounds included) and fails the calls listed in ``fail``."""

    def __init__(self, fail: tuple[int, ...] = ()) -> None:
        self.calls: list[DeclineRequest] = []
        self.fail = fail

    def decline(self, tickets: list[Ticket], reason: str = "") -> DeclineResponse:
        raw = msgspec.json.encode(DeclineRequest(tickets=tickets, reason=reason))
        self.calls.append(msgspec.json.decode(raw, type=DeclineRequest))
        if len(self.calls) - 1 in self.fail:
            raise HandshakeError("peer unreachable")
        return DeclineResponse(released=[t.hold_id for t in tickets], missing=[])


def _declines(requests: int, ranks: int) -> list[Decline]:
    """One decline per request, each with one ticket per prefill rank."""
    return [
        Decline([msgspec.to_builtins(Ticket(
            engine_id="p", epoch=1, hold_id=f"h-{r}-{k}", request_id=f"r-{r}", block_ids=[[1]],
            num_tokens=16, expires_at=0.0, tp_rank=k, tp_size=ranks, peer="127.0.0.1:9",
        )) for k in range(ranks)], "aborted")
        for r in range(requests)
    ]  # fmt: skip


def _worker(sidecar: _Sidecar) -> WorkerSide:
    worker = WorkerSide("/nonexistent/kvxferd.sock", model="m", tp_rank=0, tp_size=1)
    worker.client = sidecar  # type: ignore[assignment]
    return worker


def test_a_step_with_more_declined_tickets_than_one_call_takes_sends_several_calls():
    sidecar = _Sidecar()
    declines = _declines(requests=MAX_TICKETS_PER_CALL // 8 + 1, ranks=8)  # a request too many
    _worker(sidecar).run(StepOrders(declines=declines))
    assert [len(c.tickets) for c in sidecar.calls] == [MAX_TICKETS_PER_CALL, 8]
    sent = [t.hold_id for c in sidecar.calls for t in c.tickets]
    assert sent == [t["hold_id"] for d in declines for t in d.tickets]


def test_a_failed_decline_call_does_not_keep_the_next_from_being_sent():
    sidecar = _Sidecar(fail=(0,))
    _worker(sidecar).run(StepOrders(declines=_declines(requests=MAX_TICKETS_PER_CALL, ranks=2)))
    assert [len(c.tickets) for c in sidecar.calls] == [MAX_TICKETS_PER_CALL] * 2
