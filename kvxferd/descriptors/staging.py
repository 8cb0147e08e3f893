"""A READ staged: each remote region's rows read whole into a staging buffer, then scattered.

A decode rank that reads from many prefill ranks gets from each a slice of every block: a
rank's run of blocks is contiguous on the prefill but strided on the decode, so its rows do not
coalesce (prefill TP 8 into TP 1: 304 descriptors where TP 1 needs 8), and each descriptor costs
the transport a post of its own. Staged, the READ moves each remote region's rows as a few
whole runs into a staging buffer (one descriptor per run), and the rows are then copied locally
into place, one strided copy per progression of rows (same run, region and length; offsets
stepping evenly on both sides). Measured: scripts/bench_staging.py (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.plan import ReadPlan

MAX_GAP = 64 << 10
"""Bytes of unread remote memory a run may span between two rows (else a new run starts)."""
ALIGN = 64
"""Runs start at multiples of this in the staging buffer."""
MAX_WASTE = 2
"""A staged READ moves at most this many times the plan's bytes (else it is not staged)."""
MIN_CUT = 8
"""Staging must cut the descriptors at least this many times."""


@dataclass(frozen=True, eq=False)
class StagedPlan:
    """Runs to READ into a staging buffer, and the copies that put their rows in place.

    Runs: ``run_key`` (the remote region, numbered as the caller's ``plans`` in order:
    ``sum(len(bases) of earlier plans) + region``), ``run_offset`` (from that region's base),
    ``run_length``, ``run_at`` (offset in the staging buffer). Copies, one per progression:
    ``count`` rows of ``length`` bytes from staging offset ``stage_offset + i * stage_stride``
    to local region ``local_region`` at ``local_offset + i * local_stride``.
    """

    run_key: np.ndarray
    run_offset: np.ndarray
    run_length: np.ndarray
    run_at: np.ndarray
    nbytes: int
    """Staging bytes the runs take (aligned)."""
    local_region: np.ndarray
    local_offset: np.ndarray
    stage_offset: np.ndarray
    length: np.ndarray
    count: np.ndarray
    local_stride: np.ndarray
    stage_stride: np.ndarray

    @property
    def num_runs(self) -> int:
        """Descriptors of the staged READ."""
        return int(self.run_length.size)

    def copies(self) -> list[tuple[int, int, int, int, int, int, int]]:
        """Per progression: (local region, local offset, staging offset, length, count, local
        stride, staging stride), as Python ints."""
        cols = (self.local_region, self.local_offset, self.stage_offset, self.length,
                self.count, self.local_stride, self.stage_stride)  # fmt: skip
        return list(zip(*(c.tolist() for c in cols), strict=True))


def stage_plans(
    plans: Sequence[ReadPlan], regions: Sequence[int], *, min_descriptors: int, max_bytes: int,
    min_cut: float = MIN_CUT, max_waste: float = MAX_WASTE,
) -> StagedPlan | None:  # fmt: skip
    """The staged form of one READ made of ``plans`` (one per remote rank; ``regions[i]``: the
    remote regions plan ``i`` numbers), or None where staging does not pay: fewer than
    ``min_descriptors`` rows, a cut of fewer than ``min_cut`` times, more than ``max_waste``
    times the plan's bytes, or more than ``max_bytes`` of staging."""
    rows = sum(p.num_descriptors for p in plans)
    if rows < max(1, min_descriptors):
        return None
    first = np.cumsum([0, *regions[:-1]])
    key = np.concatenate([p.remote_region + first[i] for i, p in enumerate(plans)])
    roff = np.concatenate([p.remote_offset for p in plans])
    lreg = np.concatenate([p.local_region for p in plans])
    loff = np.concatenate([p.local_offset for p in plans])
    ln = np.concatenate([p.length for p in plans])
    order = np.lexsort((roff, key))
    key, roff, lreg, loff, ln = key[order], roff[order], lreg[order], loff[order], ln[order]
    end = roff + ln
    new = np.r_[True, (key[1:] != key[:-1]) | (roff[1:] > end[:-1] + MAX_GAP)]
    starts = np.flatnonzero(new)
    if len(starts) * min_cut > rows:
        return None
    run_lo = roff[starts]
    run_len = np.maximum.reduceat(end, starts) - run_lo
    padded = (run_len + ALIGN - 1) // ALIGN * ALIGN
    run_at = np.r_[0, np.cumsum(padded)[:-1]].astype(np.int64)
    nbytes = int(padded.sum())
    if nbytes > max_bytes or nbytes > max_waste * int(ln.sum()):
        return None
    run = np.cumsum(new) - 1
    soff = run_at[run] + roff - run_lo[run]
    return StagedPlan(key[starts], run_lo, run_len, run_at, nbytes,
                      *_progressions(run, lreg, loff, soff, ln))  # fmt: skip


def _progressions(
    run: np.ndarray, lreg: np.ndarray, loff: np.ndarray, soff: np.ndarray, ln: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Rows grouped into progressions (same run, local region and length; both offsets stepping
    by one stride each): the first row's local region, offsets and length, the count and the
    two strides. A row joins the previous row's progression when its steps equal that row's
    (greedy: correct always, fewest copies where rows lie evenly, as blocks do)."""
    order = np.lexsort((soff, ln, lreg, run))
    run, lreg, loff, soff, ln = run[order], lreg[order], loff[order], soff[order], ln[order]
    n = len(ln)
    key = np.r_[True, (run[1:] != run[:-1]) | (lreg[1:] != lreg[:-1]) | (ln[1:] != ln[:-1])]
    dl = np.r_[0, np.diff(loff)]
    ds = np.r_[0, np.diff(soff)]
    same = np.r_[False, (dl[1:] == dl[:-1]) & (ds[1:] == ds[:-1])]
    # A row starts a progression at a new key, or where its steps differ from the previous
    # row's unless that row itself started one (then its steps set the strides).
    start = key | (~same & ~np.r_[False, key[:-1]])
    starts = np.flatnonzero(start)
    count = np.diff(np.r_[starts, n])
    nxt = np.minimum(starts + 1, n - 1)
    many = count > 1
    return (lreg[starts], loff[starts], soff[starts], ln[starts], count,
            np.where(many, dl[nxt], 0), np.where(many, ds[nxt], 0))  # fmt: skip


def scatter(stage: np.ndarray, views: Sequence[np.ndarray], plan: StagedPlan) -> None:
    """Copy the staged rows from ``stage`` (uint8, the pull's staging bytes) into ``views``
    (uint8, one per local region): one strided copy per progression."""
    for r, lo, so, n, c, dl, ds in plan.copies():
        dst = np.ndarray((c, n), np.uint8, views[r], lo, (dl, 1))
        np.copyto(dst, np.ndarray((c, n), np.uint8, stage, so, (ds, 1)))


__all__ = ["StagedPlan", "scatter", "stage_plans"]
