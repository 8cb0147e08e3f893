"""A READ staged: each remote region's rows read whole into a staging buffer, then scattered.

A decode rank that reads from many prefill ranks gets from each a slice of every block: a
rank's run of blocks is contiguous on the prefill but strided on the decode, so its rows do not
coalesce (prefill TP 8 into TP 1: 304 descriptors where TP 1 needs 8), and each descriptor costs
the transport a post of its own. Staged, the READ moves each remote region's rows as a few
whole runs into a staging buffer (one descriptor per run), and the rows are then copied locally
into place, one strided copy per progression of rows (same run, region and length; offsets
stepping evenly on both sides), progressions of one shape nested in one copy. Measured:
scripts/bench_staging.py (docs/benchmarks.md).
"""

from __future__ import annotations

import itertools
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
MAX_COPY_PER_SAVED = 16 << 10
"""Bytes a staged READ may copy locally per descriptor it saves (else it is not staged). A post
saved is worth about 2 us here and the copy runs at about 10 GB/s, so past ~20 KB per saved
descriptor the copy costs more than the posts it saves (scripts/bench_staging.py --scale:
staged / direct 0.55 at 6.7 KB, 0.77 at 13 KB, 1.08 at 27 KB)."""

Copy = tuple[int, int, int, int, int, int, int, int, int, int]
"""One strided copy of :attr:`StagedPlan.copies`."""


@dataclass(frozen=True, eq=False)
class StagedPlan:
    """Runs to READ into a staging buffer, and the copies that put their rows in place.

    Runs: ``run_key`` (the remote region, numbered as the caller's ``plans`` in order:
    ``sum(len(bases) of earlier plans) + region``), ``run_offset`` (from that region's base),
    ``run_length``, ``run_at`` (offset in the staging buffer). Then ``copies``.
    """

    run_key: np.ndarray
    run_offset: np.ndarray
    run_length: np.ndarray
    run_at: np.ndarray
    nbytes: int
    """Staging bytes the runs take (aligned)."""
    copies: list[Copy]
    """Per copy: (local region, local offset, staging offset, length, count, local stride,
    staging stride, outer count, outer local stride, outer staging stride): ``outer count`` x
    ``count`` rows of ``length`` bytes, row (o, i) from staging offset ``staging offset +
    o * outer staging stride + i * staging stride`` to the local region at the same steps."""

    @property
    def num_runs(self) -> int:
        """Descriptors of the staged READ."""
        return int(self.run_length.size)


def stage_plans(
    plans: Sequence[ReadPlan], regions: Sequence[int], *, min_descriptors: int, max_bytes: int,
    min_cut: float = MIN_CUT, max_waste: float = MAX_WASTE,
    max_copy_per_saved: float = MAX_COPY_PER_SAVED,
) -> StagedPlan | None:  # fmt: skip
    """The staged form of one READ made of ``plans`` (one per remote rank; ``regions[i]``: the
    remote regions plan ``i`` numbers), or None where staging does not pay: fewer than
    ``min_descriptors`` rows, a cut of fewer than ``min_cut`` times, more than
    ``max_copy_per_saved`` bytes to copy per descriptor saved, more than ``max_waste`` times
    the plan's bytes, or more than ``max_bytes`` of staging."""
    rows = sum(p.num_descriptors for p in plans)
    if rows < max(1, min_descriptors):
        return None
    firsts = itertools.accumulate(regions, initial=0)  # each plan's first region, numbered
    key = np.concatenate([p.remote_region + f for p, f in zip(plans, firsts, strict=False)])
    roff = np.concatenate([p.remote_offset for p in plans])
    lreg = np.concatenate([p.local_region for p in plans])
    loff = np.concatenate([p.local_offset for p in plans])
    ln = np.concatenate([p.length for p in plans])
    order = np.lexsort((roff, key))
    key, roff, lreg, loff, ln = key[order], roff[order], lreg[order], loff[order], ln[order]
    end = roff + ln
    new = np.ones(rows, dtype=bool)
    new[1:] = (key[1:] != key[:-1]) | (roff[1:] > end[:-1] + MAX_GAP)
    starts = np.flatnonzero(new)
    if len(starts) * min_cut > rows or int(ln.sum()) > max_copy_per_saved * (rows - len(starts)):
        return None
    run_lo = roff[starts]
    run_len = np.maximum.reduceat(end, starts) - run_lo
    padded = (run_len + ALIGN - 1) // ALIGN * ALIGN
    run_at = np.zeros(len(starts), dtype=np.int64)
    np.cumsum(padded[:-1], out=run_at[1:])
    nbytes = int(padded.sum())
    if nbytes > max_bytes or nbytes > max_waste * int(ln.sum()):
        return None
    run = np.cumsum(new) - 1
    soff = run_at[run] + roff - run_lo[run]
    return StagedPlan(key[starts], run_lo, run_len, run_at, nbytes,
                      _copies(run, lreg, loff, soff, ln))  # fmt: skip


def _greedy(new: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
    """Progressions over sorted rows: a row joins the previous row's unless ``new`` marks it or
    its steps in ``a`` and ``b`` differ from that row's (when that row did not start one: then
    its steps set the strides). Greedy: always correct, fewest where rows lie evenly, as blocks
    do. Each progression's first row, count and two strides."""
    n = len(a)
    da, db = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    da[1:], db[1:] = a[1:] - a[:-1], b[1:] - b[:-1]
    start = new.copy()
    start[1:] |= ((da[1:] != da[:-1]) | (db[1:] != db[:-1])) & ~new[:-1]
    starts = np.flatnonzero(start)
    count = np.empty_like(starts)
    count[:-1] = starts[1:] - starts[:-1]
    count[-1:] = n - starts[-1:]
    nxt = np.minimum(starts + 1, n - 1)
    many = count > 1
    return starts, count, np.where(many, da[nxt], 0), np.where(many, db[nxt], 0)


def _copies(run: np.ndarray, lreg: np.ndarray, loff: np.ndarray, soff: np.ndarray,
            ln: np.ndarray) -> list[Copy]:  # fmt: skip
    """The copies that put staged rows in place: rows in progressions (same run, local region
    and length; both offsets stepping evenly), then progressions of the same shape in
    progressions of their own (one rank's block pieces, then the same pieces of every rank)."""
    order = np.lexsort((soff, ln, lreg, run))
    run, lreg, loff, soff, ln = run[order], lreg[order], loff[order], soff[order], ln[order]
    new = np.ones(len(ln), dtype=bool)
    new[1:] = (run[1:] != run[:-1]) | (lreg[1:] != lreg[:-1]) | (ln[1:] != ln[:-1])
    s, count, dl, ds = _greedy(new, loff, soff)
    lreg, loff, soff, ln = lreg[s], loff[s], soff[s], ln[s]
    order = np.lexsort((soff, ds, dl, count, ln, lreg))
    cols = [c[order] for c in (lreg, loff, soff, ln, count, dl, ds)]
    new = np.zeros(len(ln), dtype=bool)
    new[0] = True
    for c in (cols[0], *cols[3:]):  # a new shape: region, length, count or strides differ
        new[1:] |= c[1:] != c[:-1]
    s, outer, odl, ods = _greedy(new, cols[1], cols[2])
    return list(zip(*(c[s].tolist() for c in cols), outer.tolist(), odl.tolist(), ods.tolist(),
                    strict=True))  # fmt: skip


def scatter(stage: np.ndarray, views: Sequence[np.ndarray], plan: StagedPlan) -> None:
    """Copy the staged rows from ``stage`` (uint8, the pull's staging bytes) into ``views``
    (uint8, one per local region): one strided copy per :attr:`StagedPlan.copies` entry."""
    u8 = np.uint8
    for r, lo, so, n, c, dl, ds, oc, odl, ods in plan.copies:
        dst = np.ndarray((oc, c, n), u8, views[r], lo, (odl, dl, 1))
        np.copyto(dst, np.ndarray((oc, c, n), u8, stage, so, (ods, ds, 1)))


__all__ = ["StagedPlan", "scatter", "stage_plans"]
