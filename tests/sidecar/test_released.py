"""The released feed: bounded in records and bytes, pages bounded too, cursors never skip."""

from __future__ import annotations

import pytest

from kvxferd.errors import ConfigError
from kvxferd.sidecar.released import BYTES_PER_ID, RECORD_OVERHEAD, ReleasedLog, record_bytes
from kvxferd.wire import ReleasedHold


def record(i: int, ids: int = 4) -> ReleasedHold:
    return ReleasedHold(hold_id=f"h{i}", request_id=f"r{i}", block_ids=[list(range(1, ids + 1))],
                        reason="notified")  # fmt: skip


def test_a_record_is_estimated_from_its_block_ids():
    assert record_bytes(record(0, ids=8192)) == RECORD_OVERHEAD + 8192 * BYTES_PER_ID


def test_big_records_are_dropped_by_bytes_before_the_record_bound_is_reached():
    log = ReleasedLog(max_records=1000, max_bytes=10 * record_bytes(record(0, ids=1000)))
    for i in range(50):
        log.append(record(i, ids=1000))
    assert len(log) == 10 and log.bytes <= log.max_bytes
    assert log.get("h49") is not None and log.get("h39") is None
    page = log.since(0)
    assert [h.hold_id for h in page.holds] == [f"h{i}" for i in range(40, 50)] and not page.more


def test_pages_are_bounded_and_following_more_reads_everything_once():
    log = ReleasedLog()
    for i in range(100):
        log.append(record(i, ids=100))
    seen, cursor, pages = [], 0, 0
    while True:
        page = log.since(cursor, limit=1000, page_bytes=10 * record_bytes(record(0, ids=100)))
        seen += [h.hold_id for h in page.holds]
        cursor, pages = page.cursor, pages + 1
        if not page.more:
            break
    assert seen == [f"h{i}" for i in range(100)] and pages == 10
    huge = ReleasedLog()
    huge.append(record(0, ids=100_000))
    assert len(huge.since(0, page_bytes=1).holds) == 1  # a page always holds one record


def test_bounds_must_be_positive():
    with pytest.raises(ConfigError):
        ReleasedLog(max_bytes=0)
