"""The prefill side's notification poller: readers' NIXL notifications become hold releases.

Each poll also progresses this sidecar's UCX worker, which a reader's READ needs to complete
when the progress thread is off. After a hold, a claim or a notification the poller is fast (a
reader's READ may come before its claim), then backs off in proportion to the time since:
polling every ``elapsed / 20`` (1 ms to 50 ms) delays a READ that took ``t`` by at most ~t/20,
and a live hold whose reader never reads costs 20 polls a second instead of 1,000. Over TCP a
READ itself needs our progress (not only its notification), so while a hold is claimed the
poller stays fast there. ``get_notifs`` is called on the loop: it releases the GIL and costs
microseconds, a thread hop costs more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvxferd.errors import KvxferdError
from kvxferd.metrics import Metrics
from kvxferd.sidecar.fabric import Fabric
from kvxferd.sidecar.holds import HoldTable
from kvxferd.sidecar.wake import Wake
from kvxferd.transport import Agent

log = logging.getLogger(__name__)

FAST_S = 0.001
"""Shortest poll interval, right after a claim or a notification."""
SLOW_S = 0.05
"""Longest poll interval (and the interval with no hold claimed)."""
LATENCY_SHARE = 20
"""Poll every elapsed/20: a READ's notification is late by at most ~5%."""


class NotificationPoller:
    """Polls ``agent`` for notifications while ``holds()`` has a table; ``wake`` makes it fast
    (a claim was recorded: a READ is imminent)."""

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
        except KvxferdError as exc:
            log.warning("reading notifications failed: %s", exc)
            return False
        for reader, messages in notifs.items():
            for message in messages:
                holds.notify(message.decode(errors="replace"), reader)
        if notifs:
            self.after_release()
        return bool(notifs)

    def delay(self, holds: HoldTable, hot_since: float) -> float:
        """How long to sleep before the next poll (see the module docstring)."""
        if not holds.active:  # neither claimed nor held: nothing to read from us
            return SLOW_S
        now = time.monotonic()
        delay = min(max((now - hot_since) / LATENCY_SHARE, FAST_S), SLOW_S)
        if holds.claimed and not self.progress_thread and self.fabric.reads_over_tcp(now):
            delay = FAST_S  # over TCP a READ moves only as we progress
        return delay

    async def run(self) -> None:
        """Poll until cancelled."""
        hot_since = time.monotonic()
        while True:
            delay = SLOW_S
            holds = self.holds()
            if holds is not None:
                if self.poll(holds):
                    hot_since = time.monotonic()  # more may follow (other ranks, other pulls)
                delay = self.delay(holds, hot_since)
            live = self.agent.live_handles()
            self.metrics.nixl_handles.set(live.transfers)
            self.metrics.prepped_lists.set(live.prepped)
            if await self.wake.sleep(delay):
                hot_since = time.monotonic()
            self.wake.clear()


__all__ = ["NotificationPoller"]
