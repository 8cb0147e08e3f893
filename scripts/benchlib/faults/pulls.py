"""Run one pull on the pair and judge it against the data-plane invariants.

A pull must end DONE or FAILED by its deadline (plus slack; counted from when a stopped process
was continued). DONE: every byte of every destination block equals the hold's pattern, and a
ticket that should have been refused (forged, tampered, replayed, re-bound) never ends DONE.
FAILED: the destination blocks are snapshotted at once and compared after the decode went quiet
(no live NIXL handle, then a settle time): any change is a write after FAILED.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvxferd.pattern import verify_pattern
from kvxferd.wire import PullRequest, PullStatus, Ticket

from .pair import HoldRec, Pair
from .tally import Tally

HANG_GRACE_S = 5.0
"""Slack past a pull's deadline before it counts as hung (a loaded 2-core machine)."""
QUIET_S = 3.0
"""Longest wait for the decode's live NIXL handles to reach 0 after a FAILED pull."""
SETTLE_S = 0.5
"""Extra time after that for a straggling READ to land (the thing we look for)."""
FINAL = ("done", "failed")


@dataclass
class PullRun:
    """A started pull and what judging it needs."""

    pull_id: str
    dest: list[int]
    seed: int
    deadline_s: float
    started: float
    must_fail: str = ""
    """Why this pull must not end DONE (empty: it should succeed)."""
    resumed_at: float = 0.0
    """Monotonic time a stopped process was continued (the deadline counts from there too)."""
    holds: list[HoldRec] = field(default_factory=list)

    @property
    def bound(self) -> float:
        return max(self.started + self.deadline_s, self.resumed_at) + HANG_GRACE_S


def start(pair: Pair, tickets: list[Ticket], dest: list[int], seed: int, deadline_s: float,
          holds: Sequence[HoldRec] = (), must_fail: str = "") -> PullRun | str:  # fmt: skip
    """Start a pull into ``dest``; a PullRun, or the refusal text (a 4xx is a fine answer)."""
    req = PullRequest(tickets=tickets, block_ids=[dest], deadline_s=deadline_s)
    started = time.monotonic()
    try:
        with pair.d.client(30.0) as c:
            accepted = c.pull(req)
    except Exception as exc:  # noqa: BLE001 - refused: the caller decides whether that is fine
        pair.d_blocks.give(dest)
        return f"{type(exc).__name__}: {exc}"[:200]
    end_wall = time.time() + deadline_s
    for rec in holds:
        pair.extend_due(rec, end_wall)
    return PullRun(accepted.pull_id, dest, seed, deadline_s, started, must_fail,
                   holds=list(holds))  # fmt: skip


def status(pair: Pair, pull_id: str, wait_s: float = 0.0) -> PullStatus | None:
    """The pull's status (None when the decode does not answer)."""
    try:
        with pair.d.client(wait_s + 5.0) as c:
            return c.pull_status(pull_id, wait_s)
    except Exception:  # noqa: BLE001
        return None


ORDER = ("pending", "handshaking", "claiming", "transferring", "done", "failed")


def watch(pair: Pair, run: PullRun, phase: str, timeout_s: float = 2.0) -> str:
    """Poll the pull until it reached ``phase`` (or a later one), or ``timeout_s`` passed; the
    state it is in then (the phase a fault hits)."""
    end = run.started + timeout_s
    state = "pending"
    while time.monotonic() < end:
        st = status(pair, run.pull_id)
        if st is None:
            return "unknown"
        state = st.state
        if ORDER.index(state) >= ORDER.index(phase):
            break
        time.sleep(0.001)
    return state


def judge(pair: Pair, tally: Tally, kind: str, run: PullRun) -> str:
    """Wait (bounded) for the pull's end and check it; returns its outcome word."""
    st: PullStatus | None = None
    while True:
        left = run.bound - time.monotonic()
        st = status(pair, run.pull_id, max(0.0, min(1.0, left)))
        if st is None and not pair.d.alive():
            pair.d_blocks.give(run.dest)
            return "lost"  # the decode died: nothing can write its pool any more
        if st is not None and st.state in FINAL:
            break
        if left <= 0:
            state = st.state if st else "unanswered"
            tally.violate(kind, "hangs", f"pull still {state} {HANG_GRACE_S:g}s past its "
                          f"deadline of {run.deadline_s:.3f}s")  # fmt: skip
            return "hang"  # its blocks stay quarantined
    if st.state == "done":
        return _judge_done(pair, tally, kind, run)
    return _judge_failed(pair, tally, kind, run, st)


def _judge_done(pair: Pair, tally: Tally, kind: str, run: PullRun) -> str:
    if run.must_fail:
        tally.violate(kind, "stale_or_corrupt", f"pull DONE with {run.must_fail}")
        pair.d_blocks.give(run.dest)
        return "done"
    pool = pair.d.pool
    bad = verify_pattern(pool.manifest, pool.views, [run.dest], run.seed)
    if bad is not None:
        tally.violate(kind, "stale_or_corrupt", f"DONE pull of {len(run.dest)} blocks has a "
                      f"wrong byte: {bad}")  # fmt: skip
    pair.d_blocks.give(run.dest)
    return "done"


def _judge_failed(pair: Pair, tally: Tally, kind: str, run: PullRun, st: PullStatus) -> str:
    before = Pair.pages(pair.d.pool, run.dest)
    wait_quiet(pair)
    time.sleep(SETTLE_S)  # the window a straggling READ would use; not synchronisation
    after = Pair.pages(pair.d.pool, run.dest)
    changed = sum(int(np.count_nonzero(a != b)) for a, b in zip(after, before, strict=True))
    if changed:
        tally.violate(kind, "writes_after_failed", f"{changed} bytes of {len(run.dest)} blocks "
                      f"changed after FAILED ({st.reason}: {st.detail[:80]})")  # fmt: skip
    tally.note(kind, f"failed:{st.reason}")
    pair.d_blocks.give(run.dest)
    return "failed"


def wait_quiet(pair: Pair, timeout_s: float = QUIET_S) -> bool:
    """Bounded wait until the decode reports no live NIXL handle; whether it did."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pair.d.live_handles() == 0:
            return True
        time.sleep(0.05)
    return False
