"""The notification poller's pacing: fast right after a claim, backing off with time, and
fast for the whole claim when READs go over TCP without a progress thread."""

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


def test_right_after_a_claim_it_polls_fast_then_backs_off_in_proportion():
    p, now = _poller(), time.monotonic()
    assert p.delay(_holds(1, 1), now) == notifs.FAST_S
    later = p.delay(_holds(1, 1), now - 0.4)  # hot since 0.4 s ago: every 0.4/20 s
    assert later == pytest.approx(0.4 / notifs.LATENCY_SHARE, rel=0.05)
    assert p.delay(_holds(1, 1), now - 100) == notifs.SLOW_S  # capped


@pytest.mark.parametrize("progress_thread", [False, True])
def test_over_tcp_a_claimed_hold_keeps_it_fast_unless_a_progress_thread_runs(progress_thread):
    p = _poller(tcp=True, progress_thread=progress_thread)
    long_ago = time.monotonic() - 100
    assert p.delay(_holds(1, 1), long_ago) == (notifs.SLOW_S if progress_thread else notifs.FAST_S)
    assert p.delay(_holds(1, 0), long_ago) == notifs.SLOW_S  # held, not claimed: no READ yet
