"""A request's block ids are checked for all groups at once, with the per-group checks' verdicts:
the same arrays when valid, the same offending field and reason when not."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import geometry
from kvxferd.descriptors.geometry import check_block_ids, check_request_ids
from kvxferd.errors import BlockIdError

NUM_BLOCKS = 8


def _per_group(seq: list, num_blocks: int = NUM_BLOCKS, field: str = "block_ids"):
    try:
        return [check_block_ids(num_blocks, ids, f"{field}[{g}]") for g, ids in enumerate(seq)]
    except BlockIdError as exc:
        return exc


def _assert_agrees(seq: list, num_blocks: int = NUM_BLOCKS, field: str = "block_ids") -> None:
    """check_request_ids gives the per-group checks' arrays, or their field and reason."""
    want = _per_group(seq, num_blocks, field)
    if isinstance(want, BlockIdError):
        with pytest.raises(BlockIdError) as got:
            check_request_ids(num_blocks, len(seq), seq, field)
        assert (got.value.field, got.value.reason) == (want.field, want.reason)
        return
    got = check_request_ids(num_blocks, len(seq), seq, field)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == np.int64
        np.testing.assert_array_equal(a, b)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(-2, NUM_BLOCKS + 1), max_size=6), min_size=1, max_size=4))
def test_all_groups_at_once_agree_with_the_per_group_checks(seq):
    _assert_agrees(seq)


def test_a_repeat_across_groups_is_allowed_and_within_one_is_named():
    assert [a.tolist() for a in check_request_ids(8, 2, [[1, 2], [2, 1]], "ids")] == [
        [1, 2],
        [2, 1],
    ]
    with pytest.raises(BlockIdError) as exc:
        check_request_ids(8, 2, [[1, 2], [3, 3]], "ids")
    assert exc.value.field == "ids[1][1]"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.lists(st.integers(0, 199), max_size=30, unique=True),
            st.lists(st.integers(-1, 200), max_size=30),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_python_and_numpy_checks_give_the_per_group_checks_verdicts(seq):
    """Up to SMALL_IDS ids in all are checked as Python ints, more with numpy: both paths agree
    with the per-group checks."""
    _assert_agrees(seq, 200, "ids")
    with mock.patch.object(geometry, "SMALL_IDS", 0):
        _assert_agrees(seq, 200, "ids")
