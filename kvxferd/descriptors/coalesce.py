"""Merge descriptor pairs that continue each other on both sides into one (vectorised).

Two pairs merge when they share both regions and the second starts where the first ends, on the
local side and on the remote side alike, so the merged pair still copies byte for byte.
"""

from __future__ import annotations

import math

import numpy as np

from kvxferd.descriptors.plan import ReadPlan

SMALL_RUNS = 16
"""Up to this many pairs, runs are merged over Python ints: numpy's fixed cost per call was
most of planning a one-block pull (issue 11). Measured here: Python is faster up to about 16
pairs (2: 20 us against 72; 32: 114 against 67)."""


def merge_runs(
    keys: tuple[np.ndarray, ...],
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Sort by ``(*keys, local_offset)`` and merge runs adjacent on both sides.

    ``keys`` are arrays that must be equal within a run (regions, and strides when merging the
    parts of one block unit). Returns the merged ``(keys, local_offset, remote_offset, length)``.
    """
    if length.size <= 1:
        return keys, local_offset, remote_offset, length
    if length.size <= SMALL_RUNS:
        return _merge_small(keys, local_offset, remote_offset, length)
    order = _sort_order((*keys, local_offset))
    keys = tuple(k[order] for k in keys)
    loff, roff, ln = local_offset[order], remote_offset[order], length[order]
    cont = (loff[1:] == loff[:-1] + ln[:-1]) & (roff[1:] == roff[:-1] + ln[:-1])
    for k in keys:
        cont &= k[1:] == k[:-1]
    if not cont.any():
        return keys, loff, roff, ln
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return (
        tuple(k[starts] for k in keys),
        loff[starts],
        roff[starts],
        np.add.reduceat(ln, starts),
    )


def _merge_small(
    keys: tuple[np.ndarray, ...],
    local_offset: np.ndarray,
    remote_offset: np.ndarray,
    length: np.ndarray,
) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_runs` over Python ints: the same result, without numpy's cost per call."""
    cols = [k.tolist() for k in keys]
    loff, roff, ln = local_offset.tolist(), remote_offset.tolist(), length.tolist()
    order = sorted(range(len(ln)), key=lambda i: (*(c[i] for c in cols), loff[i]))  # stable
    out: list[list[int]] = []
    for i in order:
        row = [*(c[i] for c in cols), loff[i], roff[i], ln[i]]
        last = out[-1] if out else None
        if (last and last[:-3] == row[:-3] and row[-3] == last[-3] + last[-1]
                and row[-2] == last[-2] + last[-1]):  # fmt: skip
            last[-1] += row[-1]  # same keys, and it continues ``last`` on both sides
        else:
            out.append(row)
    merged = list(zip(*out, strict=True))
    n = len(keys)
    return (
        tuple(np.asarray(merged[j], dtype=keys[j].dtype) for j in range(n)),
        np.asarray(merged[n], dtype=local_offset.dtype),
        np.asarray(merged[n + 1], dtype=remote_offset.dtype),
        np.asarray(merged[n + 2], dtype=length.dtype),
    )


def _sort_order(cols: tuple[np.ndarray, ...]) -> np.ndarray:
    """Lexicographic order of the rows of ``cols`` (first column most significant).

    Packs the columns into one int64 key when their ranges allow (several times faster than
    ``np.lexsort``), else falls back to ``np.lexsort``. Stable either way: rows that tie keep
    their order, so a subset of rows sorts the same alone as among others (kvxferd.descriptors
    .fanin relies on it).
    """
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows, strict=True)]
    if math.prod(spans) < 1 << 62:
        key = np.zeros(cols[0].size, dtype=np.int64)
        for c, lo, span in zip(cols, lows, spans, strict=True):
            key = key * span + (c - lo)
        return np.argsort(key, kind="stable")
    return np.lexsort(tuple(reversed(cols)))


def coalesce(plan: ReadPlan) -> ReadPlan:
    """The same byte pairs as ``plan`` in as few descriptors as adjacency allows.

    The result is sorted by local region and offset; byte totals are carried over unchanged.
    """
    (lreg, rreg), loff, roff, ln = merge_runs(
        (plan.local_region, plan.remote_region),
        plan.local_offset,
        plan.remote_offset,
        plan.length,
    )
    return ReadPlan(lreg, loff, rreg, roff, ln, plan.kv_bytes, plan.state_bytes)
