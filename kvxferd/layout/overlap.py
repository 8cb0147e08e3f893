"""Exact overlap tests for periodic byte ranges, without enumerating every block.

A part repeated over ``count`` block units is a :class:`Series` of equal-length intervals a fixed
stride apart. Two series with the same stride overlap iff some block distance ``k`` brings them
together, which is one integer-interval test; different strides loop (vectorised) over the
shorter series.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Series:
    """Byte ranges ``[start + u*stride, start + u*stride + length)`` for ``u < count``."""

    start: int
    stride: int
    length: int
    count: int
    label: str

    @property
    def end(self) -> int:
        """One past the last byte of the last interval."""
        return self.start + (self.count - 1) * self.stride + self.length

    def overlaps_itself(self) -> bool:
        """Whether consecutive intervals of the series collide."""
        return self.count > 1 and self.length > self.stride


def _ceil_div(a: int | np.ndarray, b: int) -> int | np.ndarray:
    return -((-a) // b)


def _same_stride(a: Series, b: Series, stride: int) -> bool:
    # Intervals a_u and b_v meet iff d - len_a < (u - v) * stride < d + len_b, d = b0 - a0.
    d = b.start - a.start
    k_lo = max((d - a.length) // stride + 1, -(b.count - 1))
    k_hi = min(_ceil_div(d + b.length, stride) - 1, a.count - 1)
    return k_lo <= k_hi


def series_overlap(a: Series, b: Series) -> bool:
    """Whether any interval of ``a`` shares a byte with any interval of ``b`` (exact)."""
    if a.end <= b.start or b.end <= a.start:
        return False
    if a.count == 1 or b.count == 1 or a.stride == b.stride:
        stride = b.stride if a.count == 1 else a.stride
        if stride <= 0:  # both single intervals, already known to intersect
            return True
        return _same_stride(a, b, stride)
    if b.count > a.count:
        a, b = b, a
    # Walk the shorter series b; for each b_v find the u range that could meet it.
    x = b.start + np.arange(b.count, dtype=np.int64) * b.stride - a.start
    u_lo = np.maximum((x - a.length) // a.stride + 1, 0)
    u_hi = np.minimum(_ceil_div(x + b.length, a.stride) - 1, a.count - 1)
    return bool(np.any(u_lo <= u_hi))


def first_overlap(series: list[Series]) -> tuple[Series, Series] | None:
    """The first colliding pair (a series may collide with itself), or None."""
    for s in series:
        if s.overlaps_itself():
            return s, s
    ordered = sorted(series, key=lambda s: s.start)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if series_overlap(a, b):
                return a, b
    return None
