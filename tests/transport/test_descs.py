"""Descriptor tables and index arrays are normalised and checked before NIXL sees them."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.errors import DescriptorError
from kvxferd.transport import as_indices, as_xfer_table, check_pairs


def test_nx2_table_gets_the_device_column():
    out = as_xfer_table(np.array([[4096, 64], [8192, 128]], dtype=np.int64), device_id=3)
    assert out.dtype == np.uint64 and out.flags.c_contiguous
    assert out.tolist() == [[4096, 64, 3], [8192, 128, 3]]


def test_nx3_table_keeps_its_device_column_and_pair_form_is_stacked():
    assert as_xfer_table(np.array([[1, 2, 5]], np.uint64), device_id=0).tolist() == [[1, 2, 5]]
    out = as_xfer_table((np.array([10, 20]), np.array([1, 2])))
    assert out.tolist() == [[10, 1, 0], [20, 2, 0]]
    out = as_xfer_table((np.array([10], np.uint64), np.array([1], np.int64)), device_id=2)
    assert out.dtype == np.uint64 and out.flags.c_contiguous and out.tolist() == [[10, 1, 2]]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (np.zeros((0, 2), np.uint64), "empty"),
        (np.array([1, 2, 3]), "Nx2 or Nx3"),
        (np.array([[1, 2, 3, 4]]), "Nx2 or Nx3"),
        (np.array([[1.0, 2.0]]), "integers"),
        (np.array([[-1, 2]]), "negative"),
        (np.array([[1, 2], [3, 0]]), r"local\[1\]: zero-length"),
        ((np.array([1, 2]), np.array([1])), "equal length"),
        ((np.array([1]),), r"expected \(addrs, lens\)"),
        ((np.zeros(0, np.int64), np.zeros(0, np.int64)), "empty"),
        ((np.array([5, -1]), np.array([1, 1])), "negative"),
        ((np.array([5, 9]), np.array([4, 0])), r"local\[1\]: zero-length"),
        ((np.array([5.0]), np.array([4.0])), "integers"),
    ],
)
def test_malformed_tables_are_rejected_with_the_reason(table, message):
    with pytest.raises(DescriptorError, match=message):
        as_xfer_table(table, field="local")


def test_pairs_must_match_in_count_and_length():
    a = as_xfer_table(np.array([[0, 8], [100, 16]]))
    check_pairs(a, as_xfer_table(np.array([[500, 8], [900, 16]])))
    with pytest.raises(DescriptorError, match="local has 2 descriptors, remote has 1"):
        check_pairs(a, a[:1])
    with pytest.raises(DescriptorError, match="descriptor 1: local length 16 != remote length 8"):
        check_pairs(a, as_xfer_table(np.array([[500, 8], [900, 8]])))


def test_indices_become_contiguous_int32_within_range():
    out = as_indices(np.arange(10, dtype=np.int64)[::3], count=10, field="idx")
    assert out.dtype == np.int32 and out.flags.c_contiguous
    assert out.tolist() == [0, 3, 6, 9]
    assert as_indices([2, 0], count=3, field="idx").tolist() == [2, 0]


@pytest.mark.parametrize(
    ("idx", "message"),
    [
        ([], "non-empty"),
        ([[0]], "1-D"),
        ([0.5], "integers"),
        ([0, 3], r"idx\[1\] = 3 is outside \[0, 3\)"),
        ([-1], r"idx\[0\] = -1"),
    ],
)
def test_bad_indices_are_rejected(idx, message):
    with pytest.raises(DescriptorError, match=message):
        as_indices(idx, count=3, field="idx")
