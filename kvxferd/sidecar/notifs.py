"""The prefill side's notification poller: readers' NIXL notifications become hold releases.

Each poll also progresses this sidecar's UCX worker. Whether a reader's READ needs that depends
on the fabric: over TCP without a progress thread a READ moves only as we progress, so there the
poller is fast (1 ms) right after a hold or a claim (a READ may come before its claim) and for
the whole time a hold is claimed. Over CMA/shm (loopback), RDMA, or with a progress thread, the
READ needs nothing from us: a notification only frees the reader's blocks, so the poller is paced
for release latency instead, every RELEASE_S at most. A release up to ~5 ms late keeps a pull's
blocks held ~5 ms longer (at 350 pulls/s, ~2 pulls' blocks), where polling at 1 kHz cost each
prefill rank ~0.2 core: at prefill TP 8 most of the prefill CPU per pull (issue 11,
scripts/bench_pulls.py). Either way it backs off in proportion to the time since the last
notification or wake: polling every ``elapsed / 20`` (up to 50 ms) delays a READ or release that
took ``t`` by at most ~t/20, and a live hold whose reader never reads costs 20 polls a second.
``get_notifs`` is called on the loop: it releases the GIL and costs microseconds, a thread hop
costs more.

A claim progresses UCX at once (:meth:`NotificationPoller.claimed`), whatever the pacing: the
first READ a reader posts after its last notification to us (a UCX active message over TCP)
completes only once we progress after it was posted, even where the READ itself is a CMA copy;
the READ after that one needs nothing from us. Measured with bare agents (a 1 MiB READ after a
standalone notification, target polling every 2 ms): 2.2 ms median, 3 s with the target paused;
0.2 ms without a notification before it; with the target paused 0.5 s after it had progressed
the notification: 500 ms, then 0.4 ms for the next READ. Back to back pulls at 1 in flight took
7.7 ms in the sidecar with the 5 ms pacing alone, 2.5 ms with the claim's poll
(``scripts/bench_pulls.py --inflight 1``). Such a reader posts its READ just before it sends the
claim, so the claim's poll finds the READ's request waiting (posted after the claim, p90 of the
READ's completion at concurrency 1 was 5 ms: one paced poll; ``scripts/bench_control.py``). A
striped reader (``--read-stripes`` 2 and up) READs a small pull on a stripe agent that never
notifies us: that READ needs nothing from us over CMA or RDMA, so it claims first (its first
two READs from us connect its endpoints, which does need us: those go before their claims;
kvxferd.transport.stripes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvxferd.aio import Wake
from kvxferd.errors import KvxferdError
from kvxferd.metrics import Metrics
from kvxferd.sidecar.fabric import Fabric
from kvxferd.sidecar.holds import HoldTable
from kvxferd.transport import Agent
from kvxferd.wire import HOLD_ID_MAX_LENGTH

log = logging.getLogger(__name__)

FAST_S = 0.001
"""Shortest poll interval, right after a claim or a notification."""
RELEASE_S = 0.005
"""Shortest poll interval where READs need no progress from us: how late a release may be."""
SLOW_S = 0.05
"""Longest poll interval (and the interval with no hold claimed)."""
LATENCY_SHARE = 20
"""Poll every elapsed/20: a READ's notification is late by at most ~5%."""


class NotificationPoller:
    """Polls ``agent`` for notifications while ``holds()`` has a table; ``wake`` (a hold or a
    claim was recorded: a READ is imminent) makes it poll soon."""

    def __init__(
        self,
        *,
        agent: Agent,
        holds: Callable[[], HoldTable | None],
        fabric: Fabric,
        metrics: Metrics,
        progress_thread: bool,
        after_release: Callable[[], None],
    ) -> None:
        self.agent = agent
        self.holds = holds
        self.fabric = fabric
        self.metrics = metrics
        self.progress_thread = progress_thread
        self.after_release = after_release
        self.wake = Wake()

    def poll(self, holds: HoldTable) -> bool:
        """Read notifications once and release what they name; whether any arrived."""
        try:
            notifs = self.agent.get_notifs()
        except KvxferdError as exc:  # e.g. a sender's name NIXL cannot decode: polling goes on
            self.metrics.notification_polls_failed.inc()
            log.warning("reading notifications failed: %s", exc)
            return False
        for reader, messages in notifs.items():
            for message in messages:
                # Longer than a hold id: names none (a stranger's 64 MiB is not decoded, hashed)
                fits = len(message) <= HOLD_ID_MAX_LENGTH
                holds.notify(message.decode(errors="replace") if fits else "", reader)
        if notifs:
            self.after_release()
        return bool(notifs)

    def claimed(self, holds: HoldTable) -> None:
        """A claim was recorded: progress UCX now (the claimant's READ may wait on its last
        notification to us; see the module docstring) and poll soon after."""
        self.poll(holds)
        self.wake.set()

    def reads_need_us(self, now: float) -> bool:
        """Whether a reader's READ moves only as this poller progresses UCX (TCP, no progress
        thread); otherwise polling only delivers notifications (releases)."""
        return not self.progress_thread and self.fabric.reads_over_tcp(now)

    def delay(self, holds: HoldTable, hot_since: float) -> float:
        """How long to sleep before the next poll (see the module docstring)."""
        if not holds.active:  # neither claimed nor held: nothing to read from us
            return SLOW_S
        now = time.monotonic()
        if not self.reads_need_us(now):  # paced for release latency only
            return min(max((now - hot_since) / LATENCY_SHARE, RELEASE_S), SLOW_S)
        if holds.claimed:
            return FAST_S  # over TCP a READ moves only as we progress
        return min(max((now - hot_since) / LATENCY_SHARE, FAST_S), SLOW_S)

    def wake_lag(self, now: float) -> float:
        """How long after a wake (a hold or a claim) to poll: at once where the READ needs us,
        else RELEASE_S (what comes is a notification: a release may be that late)."""
        return 0.0 if self.reads_need_us(now) else RELEASE_S

    async def run(self) -> None:
        """Poll until cancelled."""
        hot_since = time.monotonic()
        gauged = float("-inf")
        while True:
            delay = SLOW_S
            holds = self.holds()
            if holds is not None:
                if self.poll(holds):
                    hot_since = time.monotonic()  # more may follow (other ranks, other pulls)
                delay = self.delay(holds, hot_since)
            now = time.monotonic()
            if now - gauged >= SLOW_S:  # gauges for scrapes: not worth 200 updates a second
                gauged = now
                live = self.agent.live_handles()
                self.metrics.nixl_handles.set(live.transfers)
                self.metrics.prepped_lists.set(live.prepped)
            if await self.wake.sleep(delay):
                hot_since = time.monotonic()
                lag = self.wake_lag(hot_since)
                if lag > 0:  # not woken again meanwhile: a wake per claim would make it 1 kHz
                    await asyncio.sleep(lag)
            self.wake.clear()


__all__ = ["NotificationPoller"]
