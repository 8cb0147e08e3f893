"""The notification poller's pacing: where a READ needs our UCX progress (TCP, no progress
thread) fast right after a hold and for the whole claim; elsewhere (CMA, RDMA, a progress
thread) paced for release latency only; backing off with time since the last notification."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvxferd.sidecar import notifs
from kvxferd.sidecar.notifs import NotificationPoller


def _poller(*, tcp: bool = False, progress_thread: bool = False) -> NotificationPoller:
    fabric = SimpleNamespace(reads_over_tcp=lambda now: tcp)
    return NotificationPoller(
        agent=None, holds=lambda: None, fabric=fabric, metrics=None,
        progress_thread=progress_thread, after_release=lambda: None,
    )  # fmt: skip


def _holds(active: int, claimed: int) -> SimpleNamespace:
    return SimpleNamespace(active=active, claimed=claimed)


def test_with_no_hold_the_poller_polls_slowly():
    assert _poller().delay(_holds(0, 0), time.monotonic()) == notifs.SLOW_S


def test_over_tcp_right_after_a_hold_it_polls_fast_then_backs_off_in_proportion():
    p, now = _poller(tcp=True), time.monotonic()
    assert p.delay(_holds(1, 0), now) == notifs.FAST_S  # the READ may come before its claim
    later = p.delay(_holds(1, 0), now - 0.4)  # hot since 0.4 s ago: every 0.4/20 s
    assert later == pytest.approx(0.4 / notifs.LATENCY_SHARE, rel=0.05)
    assert p.delay(_holds(1, 0), now - 100) == notifs.SLOW_S  # capped


@pytest.mark.parametrize("tcp,progress_thread", [(False, False), (True, True)])
def test_where_reads_need_no_progress_from_us_it_is_paced_for_release_latency(tcp, progress_thread):
    p, now = _poller(tcp=tcp, progress_thread=progress_thread), time.monotonic()
    assert not p.reads_need_us(now)
    assert p.delay(_holds(1, 1), now) == notifs.RELEASE_S  # a fresh claim: not 1 kHz
    assert notifs.RELEASE_S > notifs.FAST_S
    later = p.delay(_holds(1, 1), now - 0.4)
    assert later == pytest.approx(0.4 / notifs.LATENCY_SHARE, rel=0.05)
    assert p.delay(_holds(1, 1), now - 100) == notifs.SLOW_S


@pytest.mark.parametrize("tcp,progress_thread,lag", [
    (True, False, 0.0), (False, False, notifs.RELEASE_S), (True, True, notifs.RELEASE_S),
])  # fmt: skip
def test_a_wake_polls_at_once_only_where_the_read_needs_us(tcp, progress_thread, lag):
    p = _poller(tcp=tcp, progress_thread=progress_thread)
    assert p.wake_lag(time.monotonic()) == lag


@pytest.mark.parametrize("progress_thread", [False, True])
def test_over_tcp_a_claimed_hold_keeps_it_fast_unless_a_progress_thread_runs(progress_thread):
    p = _poller(tcp=True, progress_thread=progress_thread)
    long_ago = time.monotonic() - 100
    assert p.delay(_holds(1, 1), long_ago) == (notifs.SLOW_S if progress_thread else notifs.FAST_S)
    assert p.delay(_holds(1, 0), long_ago) == notifs.SLOW_S  # held, not claimed: no READ yet


def test_a_claim_progresses_ucx_at_once_and_releases_what_arrived_before_it():
    """A reader's READ waits on its previous notification to us until we progress (over CMA
    too): a claim must not wait for the paced poll."""
    notified: list[tuple[str, str]] = []
    released: list[int] = []
    agent = SimpleNamespace(get_notifs=lambda: {"reader-a": [b"hold-1"]})
    holds = SimpleNamespace(notify=lambda hold, reader: notified.append((hold, reader)))
    p = NotificationPoller(
        agent=agent, holds=lambda: holds, fabric=SimpleNamespace(reads_over_tcp=lambda now: False),
        metrics=None, progress_thread=False, after_release=lambda: released.append(1),
    )  # fmt: skip
    assert not p.wake.is_set()
    p.claimed(holds)
    assert notified == [("hold-1", "reader-a")]
    assert released == [1]
    assert p.wake.is_set()  # and the poller comes round soon for the READ's own notification


@pytest.mark.nixl
def test_a_message_too_long_for_a_hold_id_is_ignored_without_copies_of_it(caplog):
    """NIXL hands over what anyone holding our metadata sends, 16 MiB in one notification too:
    a message longer than a hold id (128 characters) names no hold, and costs the loop no copy
    (it was decoded, hashed as a key, and repr'd whole by its log line: three copies)."""
    import tracemalloc
    import uuid

    from kvxferd.metrics import Metrics
    from kvxferd.sidecar.holds import HoldTable
    from kvxferd.transport import Agent
    from kvxferd.wire import HoldRequest
    from tests.sidecar.harness import plan, wait_until

    caplog.set_level("INFO", logger="kvxferd.sidecar.holds")  # the unknown one is logged
    holds = HoldTable(plan("llama-3.1-8b", num_blocks=8))
    hold = holds.hold(HoldRequest(request_id="r1", block_ids=[[1]], num_tokens=16))
    size = 16 << 20
    with (
        Agent(f"target-{uuid.uuid4().hex[:8]}", progress_thread=False) as target,
        Agent(f"stranger-{uuid.uuid4().hex[:8]}", progress_thread=False) as stranger,
    ):
        poller = NotificationPoller(
            agent=target, holds=lambda: holds, fabric=SimpleNamespace(reads_over_tcp=lambda n: 0),
            metrics=Metrics(), progress_thread=False, after_release=lambda: None,
        )  # fmt: skip
        stranger.send_notif(stranger.add_remote(target.get_agent_metadata()),
                            hold.hold_id.encode() + b" " * (size - len(hold.hold_id)))  # fmt: skip
        tracemalloc.start()
        try:

            def polled() -> bool:
                stranger.get_notifs()  # progresses the stranger's worker: the message goes out
                return poller.poll(holds)

            wait_until(polled, 30, "the long notification polled")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert holds.counters.notifications_unknown == 1 and hold.hold_id in holds
    assert peak < size + (4 << 20), f"{peak} B at peak for a {size} B notification"
    assert "for unknown hold ''" in caplog.text
