"""Deadline buckets: moves are O(1), nothing accumulates, due items come out in slices."""

from __future__ import annotations

import pytest

from kvxferd.sidecar.deadlines import DeadlineBuckets


def test_items_come_out_bucket_by_bucket_at_most_max_items_at_a_time():
    b = DeadlineBuckets(0.5)
    deadlines = {f"h{i}": 10.0 + i * 0.1 for i in range(30)}
    for item, d in deadlines.items():
        b.set(item, d)
    assert b.next_end() == 10.5
    assert b.due(9.99, 100, deadlines.__getitem__) == []
    first = b.due(20.0, 7, deadlines.__getitem__)
    assert first == [f"h{i}" for i in range(7)]
    rest = b.due(20.0, 100, deadlines.__getitem__)
    assert first + rest == list(deadlines) and len(b) == 0 and b.next_end() is None


def test_the_bucket_now_falls_in_releases_only_what_is_due():
    b = DeadlineBuckets(1.0)
    deadlines = {"a": 5.2, "b": 5.8}
    for item, d in deadlines.items():
        b.set(item, d)
    assert b.due(5.5, 10, deadlines.__getitem__) == ["a"]
    assert b.due(5.8, 10, deadlines.__getitem__) == ["b"]


def test_moving_and_dropping_leaves_no_residue():
    b = DeadlineBuckets(0.05)
    for i in range(1000):
        b.set("h", i * 0.5)
    assert len(b) == 1 and b.buckets <= 1000
    b.drop("h")
    b.drop("h")  # twice: a no-op
    assert b.next_end() is None and b.buckets == 0


def test_the_resolution_must_be_positive():
    with pytest.raises(ValueError):
        DeadlineBuckets(0.0)
