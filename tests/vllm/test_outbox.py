"""Outbox: a worker's step hands its declines and keepalives over and goes on, whatever the
sidecar (or the prefill it asks) does; what waits meanwhile is bounded and sent in the next round,
declines first."""

from __future__ import annotations

import threading

from kvxferd.vllm.outbox import MAX_PENDING, Outbox
from kvxferd.vllm.scheduler import Decline
from kvxferd.wire import MAX_TICKETS_PER_CALL, DeclineResponse, HeartbeatResponse
from tests.sidecar.harness import wait_until


class StuckClient:
    """A sidecar connection whose calls wait until the test lets them go (as one naming a
    prefill that does not answer waits for the peer timeout)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []  # (call, tickets, extend_s or reason)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = False

    def keepalive(self, tickets, extend_s):  # noqa: ANN001, ANN201
        self._enter("keepalive", tickets, extend_s)
        return HeartbeatResponse(extended=[t.hold_id for t in tickets], missing=[])

    def decline(self, tickets, reason):  # noqa: ANN001, ANN201
        self._enter("decline", tickets, reason)
        return DeclineResponse(released=[t.hold_id for t in tickets], missing=[])

    def _enter(self, call: str, tickets: list, arg: object) -> None:
        self.calls.append((call, len(tickets), arg))
        self.entered.set()
        assert self.release.wait(30)

    def close(self) -> None:
        self.closed = True


def _tickets(n: int, first: int = 0) -> list[dict]:
    return [
        dict(engine_id="P", epoch=1, hold_id=f"{i:032x}", request_id=f"r{i}", block_ids=[[1]],
             num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:9")
        for i in range(first, first + n)
    ]  # fmt: skip


def _returns(call, *args) -> bool:  # noqa: ANN001
    """Whether ``call(*args)`` returned within a bounded wait (it runs in a thread)."""
    t = threading.Thread(target=call, args=args, daemon=True)
    t.start()
    t.join(10)
    return not t.is_alive()


def test_a_keepalive_nobody_answers_does_not_hold_up_the_step_and_what_waits_is_bounded(caplog):
    client = StuckClient()
    outbox = Outbox(lambda: client, 30.0)
    outbox.keepalive(_tickets(1))
    assert client.entered.wait(30)  # the sender's thread is inside the call, stuck
    assert _returns(outbox.keepalive, _tickets(MAX_PENDING + 5, first=1))  # the step goes on
    assert "5 tickets not queued" in caplog.text
    client.release.set()
    calls = MAX_PENDING // MAX_TICKETS_PER_CALL
    wait_until(lambda: len(client.calls) == 1 + calls, 30, "the next round")
    assert (
        client.calls
        == [("keepalive", 1, 30.0)] + [("keepalive", MAX_TICKETS_PER_CALL, 30.0)] * calls
    )
    outbox.close()
    assert client.closed


def test_a_decline_nobody_answers_does_not_hold_up_the_step_and_what_waits_is_bounded(caplog):
    client = StuckClient()
    outbox = Outbox(lambda: client, 30.0)
    outbox.decline([Decline(_tickets(1), "aborted")])
    assert client.entered.wait(30)  # the sender's thread is inside the call, stuck
    assert _returns(outbox.decline, [Decline(_tickets(MAX_PENDING - 2, first=1), "aborted")])
    assert _returns(outbox.decline, [Decline(_tickets(7, first=MAX_PENDING), "store_hit")])
    assert "5 tickets not queued" in caplog.text  # beyond the bound: they end with their lease
    client.release.set()
    calls = 1 + (MAX_PENDING - 2 + MAX_TICKETS_PER_CALL - 1) // MAX_TICKETS_PER_CALL + 1
    wait_until(lambda: len(client.calls) == calls, 30, "the next round")
    assert sum(n for call, n, _ in client.calls) == 1 + MAX_PENDING
    assert {reason for _, _, reason in client.calls} == {"aborted", "store_hit"}  # one a call
    assert client.calls[-1] == ("decline", 2, "store_hit")
    outbox.close()
    assert client.closed


def test_declines_queued_with_keepalives_go_first_and_closing_still_sends_them():
    client = StuckClient()
    outbox = Outbox(lambda: client, 30.0)
    outbox.keepalive(_tickets(1))
    assert client.entered.wait(30)  # busy: what follows waits for the next round
    outbox.keepalive(_tickets(3, first=1))
    outbox.decline([Decline(_tickets(2, first=4), "computed_locally")])
    client.release.set()
    wait_until(lambda: len(client.calls) == 3, 30, "the next round")
    assert client.calls == [
        ("keepalive", 1, 30.0),
        ("decline", 2, "computed_locally"),
        ("keepalive", 3, 30.0),
    ]
    outbox.decline([Decline(_tickets(1, first=9), "aborted")])
    outbox.close()  # a decline queued as the engine shuts down still goes out
    wait_until(lambda: client.closed, 30, "the sender's end")
    assert client.calls[3:] == [("decline", 1, "aborted")]


def test_a_sender_never_used_starts_no_thread_and_closes_at_once():
    outbox = Outbox(lambda: StuckClient(), 30.0)
    outbox.keepalive([])
    outbox.decline([])
    assert outbox._thread is None
    outbox.close()
    outbox.keepalive(_tickets(1))  # after close: dropped, nothing started
    outbox.decline([Decline(_tickets(1), "aborted")])
    assert outbox._thread is None
