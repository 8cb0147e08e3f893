"""Coalescing merges only what is contiguous on both sides, and never changes what is copied."""

from __future__ import annotations

import importlib
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import ReadPlan, coalesce, merge_runs, plan_read

from . import oracle
from .test_mapping import pairs

coalesce_module = importlib.import_module("kvxferd.descriptors.coalesce")  # the package's
# ``coalesce`` is the function

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def plan(*rows: tuple[int, int, int, int, int]) -> ReadPlan:
    cols = [np.asarray(c, dtype=np.int64) for c in zip(*rows, strict=True)]
    return ReadPlan(cols[0], cols[1], cols[2], cols[3], cols[4], int(cols[4].sum()), 0)


def rows(p: ReadPlan) -> list[tuple[int, ...]]:
    return list(
        zip(
            *(a.tolist() for a in (p.local_region, p.local_offset, p.remote_region,
                                   p.remote_offset, p.length)),
            strict=True,
        )
    )  # fmt: skip


def test_adjacent_on_both_sides_merges_in_any_order():
    p = plan((0, 10, 1, 50, 5), (0, 0, 1, 40, 10), (0, 15, 1, 55, 1))
    assert rows(coalesce(p)) == [(0, 0, 1, 40, 16)]


def test_adjacent_on_one_side_only_stays_apart():
    p = plan((0, 0, 1, 40, 10), (0, 10, 1, 60, 10), (0, 20, 2, 70, 10))
    assert rows(coalesce(p)) == rows(p)


def test_regions_break_runs():
    p = plan((0, 0, 0, 0, 8), (1, 8, 0, 8, 8))
    assert coalesce(p).num_descriptors == 2


def test_empty_plan_stays_empty():
    assert coalesce(ReadPlan.empty()).num_descriptors == 0


@SETTINGS
@given(pairs())
def test_coalesced_plan_copies_the_same_byte_pairs_with_fewer_descriptors(case):
    local, remote, lids, rids = case
    loose = plan_read(local, remote, lids, rids, coalesce=False)
    tight = plan_read(local, remote, lids, rids, coalesce=True)
    assert oracle.byte_pairs(local, remote, tight) == oracle.byte_pairs(local, remote, loose)
    assert tight.num_descriptors <= loose.num_descriptors
    assert (tight.kv_bytes, tight.state_bytes) == (loose.kv_bytes, loose.state_bytes)
    assert int(tight.length.sum()) == int(loose.length.sum())


@SETTINGS
@given(pairs())
def test_coalesced_plan_has_no_mergeable_neighbours(case):
    local, remote, lids, rids = case
    p = plan_read(local, remote, lids, rids)
    end_l, end_r = p.local_offset + p.length, p.remote_offset + p.length
    for a in range(p.num_descriptors):
        follows = (
            (p.local_region == p.local_region[a])
            & (p.remote_region == p.remote_region[a])
            & (p.local_offset == end_l[a])
            & (p.remote_offset == end_r[a])
        )
        assert not follows.any()


_ROW = st.tuples(
    st.integers(0, 2), st.integers(0, 2), st.integers(0, 6), st.integers(0, 6), st.integers(1, 3)
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ROW, min_size=0, max_size=coalesce_module.SMALL_RUNS))
def test_small_runs_merge_exactly_as_the_vectorised_path(rows_):
    """Up to SMALL_RUNS pairs are merged over Python ints; numpy gives the same, dtypes too."""
    cols = [np.asarray(c, dtype=np.int64) for c in zip(*rows_, strict=True)] or [
        np.zeros(0, np.int64) for _ in range(5)
    ]
    keys = (cols[0], cols[1].astype(np.int32))
    small = merge_runs(keys, cols[2] * 4, cols[3] * 4, cols[4] * 4)
    with mock.patch.object(coalesce_module, "SMALL_RUNS", 0):
        vectorised = merge_runs(keys, cols[2] * 4, cols[3] * 4, cols[4] * 4)
    for a, b in zip((*small[0], *small[1:]), (*vectorised[0], *vectorised[1:]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
