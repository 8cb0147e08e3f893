"""Checks once a fault is over and the pair is at rest: holds released exactly once, no live
NIXL handle, both APIs of both sidecars answer, RSS, fds and threads within bounds.

A sidecar that stopped answering is counted and then restarted, so the campaign goes on.
"""

from __future__ import annotations

import time

from . import osproc
from .pair import Pair
from .tally import Tally

HANDLES_QUIET_S = 3.0
FD_SLACK = 64
THREAD_SLACK = 32
RSS_SLACK = 256 << 20


class Rest:
    """Runs the at-rest checks; remembers per-process baselines of RSS, fds and threads."""

    def __init__(self, pair: Pair, tally: Tally) -> None:
        self.pair = pair
        self.tally = tally
        self._base: dict[tuple[str, int], osproc.Usage] = {}

    def check(self, kind: str) -> None:
        self.health(kind)
        self.holds(kind)
        self.handles(kind)
        self.resources(kind)

    def health(self, kind: str) -> None:
        for node in (self.pair.p, self.pair.d):
            problem = node.problem()
            if problem:
                self.tally.violate(kind, "crashes", problem)
                node.restart()

    def holds(self, kind: str, final: bool = False) -> None:
        """Every hold of the running prefill released once by its due time; ``final`` waits
        (bounded) for the last ones."""
        pair = self.pair
        pair.poll_feed()
        if final:
            wait = max([0.0] + [r.due - time.time() for r in pair.pending()]) + 1.0
            end = time.monotonic() + min(wait, 60.0)
            while pair.pending() and time.monotonic() < end:
                time.sleep(0.1)
                pair.poll_feed()
        for rec in pair.overdue(time.time() if not final else float("inf")):
            self.tally.violate(rec.kind, "leaked_holds", f"hold {rec.ticket.hold_id[:8]} of "
                               f"{len(rec.blocks)} blocks never released")  # fmt: skip
        for placed_by, hold_id in pair.take_duplicates():
            what = f"hold {hold_id[:8]} released twice"
            self.tally.violate(placed_by or kind, "leaked_holds", what)

    def handles(self, kind: str) -> None:
        for node in (self.pair.p, self.pair.d):
            end = time.monotonic() + HANDLES_QUIET_S
            live = node.live_handles()
            while live != 0 and time.monotonic() < end:
                time.sleep(0.05)
                live = node.live_handles()
            if live:
                self.tally.violate(
                    kind, "leaked_handles", f"{node.name}: {live:g} live NIXL handles at rest"
                )
                node.restart()  # start the next fault from a clean sidecar

    def resources(self, kind: str) -> None:
        for node in (self.pair.p, self.pair.d):
            now = node.usage()
            if now is None:
                continue
            key = (node.name, node.generation)
            base = self._base.setdefault(key, now)
            grown = []
            if now.fds > base.fds + FD_SLACK:
                grown.append(f"fds {base.fds}->{now.fds}")
            if now.threads > base.threads + THREAD_SLACK:
                grown.append(f"threads {base.threads}->{now.threads}")
            if now.rss_bytes > base.rss_bytes + RSS_SLACK:
                grown.append(f"RSS {base.rss_bytes >> 20}->{now.rss_bytes >> 20} MiB")
            if grown:
                self.tally.violate(kind, "leaked_handles", f"{node.name}: " + ", ".join(grown))
                self._base[key] = now
