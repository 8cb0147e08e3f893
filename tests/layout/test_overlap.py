"""Periodic-interval overlap is exact: it agrees with enumerating every byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.layout.overlap import Series, first_overlap, series_overlap


def bytes_of(s: Series) -> set[int]:
    return {s.start + u * s.stride + x for u in range(s.count) for x in range(s.length)}


series = st.builds(
    Series,
    start=st.integers(0, 60),
    stride=st.integers(1, 12),
    length=st.integers(1, 12),
    count=st.integers(1, 8),
    label=st.just("s"),
)


@settings(max_examples=400, deadline=None)
@given(series, series)
def test_matches_enumeration(a, b):
    assert series_overlap(a, b) == bool(bytes_of(a) & bytes_of(b))


def test_interleaved_series_do_not_overlap():
    k = Series(0, 8, 4, 100_000, "k")
    v = Series(4, 8, 4, 100_000, "v")
    assert not series_overlap(k, v)
    assert series_overlap(k, Series(7, 8, 2, 100_000, "v2"))


def test_far_offset_meets_only_through_the_last_blocks():
    k = Series(0, 10, 10, 1000, "k")  # covers [0, 10000)
    assert series_overlap(k, Series(9999, 10, 1, 5, "tail"))
    assert not series_overlap(k, Series(10000, 10, 10, 5, "after"))


def test_first_overlap_reports_self_overlap():
    s = Series(0, 4, 5, 3, "wide")
    assert first_overlap([s]) == (s, s)
    assert first_overlap([Series(0, 4, 4, 3, "ok")]) is None
