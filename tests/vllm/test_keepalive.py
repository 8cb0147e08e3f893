"""KeepaliveSender: a worker's step hands its keepalives over and goes on, whatever the sidecar
(or the prefill it asks) does; what waits meanwhile is bounded and sent in the next round."""

from __future__ import annotations

import threading

from kvxferd.vllm.keepalive import MAX_PENDING, KeepaliveSender
from kvxferd.wire import MAX_TICKETS_PER_CALL, HeartbeatResponse
from tests.sidecar.harness import wait_until


class StuckClient:
    """A sidecar connection whose first keepalive waits until the test lets it go (as one
    naming a prefill that does not answer waits for the peer timeout)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []  # (tickets, extend_s) per call
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = False

    def keepalive(self, tickets, extend_s):  # noqa: ANN001, ANN201
        self.calls.append((len(tickets), extend_s))
        self.entered.set()
        assert self.release.wait(30)
        return HeartbeatResponse(extended=[t.hold_id for t in tickets], missing=[])

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
    sender = KeepaliveSender(lambda: client, 30.0)
    sender.send(_tickets(1))
    assert client.entered.wait(30)  # the sender's thread is inside the call, stuck
    assert _returns(sender.send, _tickets(MAX_PENDING + 5, first=1))  # the step goes on
    assert "5 tickets not queued" in caplog.text
    client.release.set()
    calls = MAX_PENDING // MAX_TICKETS_PER_CALL
    wait_until(lambda: len(client.calls) == 1 + calls, 30, "the next round")
    assert client.calls == [(1, 30.0)] + [(MAX_TICKETS_PER_CALL, 30.0)] * calls
    sender.close()
    assert client.closed


def test_a_sender_never_used_starts_no_thread_and_closes_at_once():
    sender = KeepaliveSender(lambda: StuckClient(), 30.0)
    sender.send([])
    assert sender._thread is None
    sender.close()
    sender.send(_tickets(1))  # after close: dropped, nothing started
    assert sender._thread is None
