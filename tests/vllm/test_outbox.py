"""Outbox: a worker's step hands its declines and keepalives over and goes on, whatever the
sidecar (or the prefill it asks) does; what waits meanwhile is bounded and sent in the next round,
declines first."""

from __future__ import annotations

import threading

from kvxferd.vllm.outbox import CONNECT_TRIES, MAX_PENDING, Outbox
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


class FlakyConnect:
    """A ``connect`` that raises its first ``fails`` times (a sidecar restarting, or the worker
    out of file descriptors), then gives ``client``."""

    def __init__(self, client: StuckClient, fails: int) -> None:
        self.client, self.fails, self.tries = client, fails, 0

    def __call__(self) -> StuckClient:
        self.tries += 1
        if self.tries <= self.fails:
            raise OSError(24, "Too many open files")
        return self.client


def test_a_sender_whose_connection_failed_tries_again_and_sends_what_waits(caplog):
    client = StuckClient()
    client.release.set()
    connect = FlakyConnect(client, fails=2)
    outbox = Outbox(connect, 30.0)
    outbox.decline([Decline(_tickets(2), "aborted")])
    wait_until(lambda: len(client.calls) == 1, 30, "the decline sent")
    assert client.calls == [("decline", 2, "aborted")] and connect.tries == 3
    assert caplog.text.count("Too many open files") == 2  # each failed try logged
    outbox.keepalive(_tickets(1, first=2))  # the thread goes on with its one connection
    wait_until(lambda: len(client.calls) == 2, 30, "the keepalive sent")
    assert connect.tries == 3
    outbox.close()
    assert client.closed


def test_a_sender_that_gave_up_connecting_starts_again_at_the_next_hand_over(caplog):
    client = StuckClient()
    client.release.set()
    connect = FlakyConnect(client, fails=CONNECT_TRIES)
    outbox = Outbox(connect, 30.0)
    outbox.decline([Decline(_tickets(2), "aborted")])
    wait_until(lambda: outbox._thread is None, 30, "the sender giving up")  # bounded tries
    assert connect.tries == CONNECT_TRIES and client.calls == []
    assert f"gave up connecting after {CONNECT_TRIES} tries" in caplog.text
    outbox.keepalive(_tickets(1, first=2))  # the next step's: a new sender, declines first
    wait_until(lambda: len(client.calls) == 2, 30, "what waited sent")
    assert client.calls == [("decline", 2, "aborted"), ("keepalive", 1, 30.0)]
    outbox.close()
    assert client.closed


def test_a_sender_closed_while_it_waits_to_connect_again_ends_at_once():
    entered, release, tries = threading.Event(), threading.Event(), []

    def connect() -> StuckClient:  # fails once the outbox has closed meanwhile
        tries.append(1)
        entered.set()
        assert release.wait(30)
        raise OSError(111, "Connection refused")

    outbox = Outbox(connect, 30.0)
    outbox.decline([Decline(_tickets(1), "aborted")])
    assert entered.wait(30)
    thread = outbox._thread
    assert thread is not None
    outbox.close()  # (waits CLOSE_WAIT_S for the sender, stuck in its try)
    release.set()
    thread.join(10)
    assert not thread.is_alive() and len(tries) == 1  # no further try after the close
