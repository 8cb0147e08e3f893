"""The finished-pulls feed: in finishing order, paged by a cursor, bounded in records and bytes."""

from __future__ import annotations

from kvxferd.sidecar import finished as finished_mod
from kvxferd.sidecar.finished import FinishedFeed
from kvxferd.wire import FinishedPull


def _pull(i: int, blocks: int = 0) -> FinishedPull:
    failed = [[*range(blocks)]] if blocks else []
    return FinishedPull(pull_id=f"p{i}", request_id=f"r{i}", state="failed" if blocks else "done",
                        reason="deadline" if blocks else "", failed_block_ids=failed)  # fmt: skip


def _ids(page) -> list[str]:  # noqa: ANN001
    return [p.pull_id for p in page.pulls]


def test_pages_follow_the_cursor_oldest_first():
    feed = FinishedFeed()
    for i in range(5):
        feed.add(_pull(i))
    first = feed.since(0, limit=2)
    assert (_ids(first), first.cursor, first.more) == (["p0", "p1"], 2, True)
    rest = feed.since(first.cursor, limit=10)
    assert (_ids(rest), rest.cursor, rest.more) == (["p2", "p3", "p4"], 5, False)
    empty = feed.since(rest.cursor)
    assert (empty.pulls, empty.cursor, empty.more) == ([], 5, False)
    feed.add(_pull(5))
    assert _ids(feed.since(rest.cursor)) == ["p5"]


def test_a_cursor_from_a_previous_sidecar_is_brought_back_to_this_feed():
    feed = FinishedFeed()
    feed.add(_pull(0))
    assert feed.since(1000).cursor == 1  # past the end: the engine continues from here


def test_the_feed_is_bounded_in_records_and_drops_the_oldest():
    feed = FinishedFeed(max_records=3)
    for i in range(5):
        feed.add(_pull(i))
    assert len(feed) == 3
    page = feed.since(0)
    assert (_ids(page), page.cursor) == (["p2", "p3", "p4"], 5)  # p0, p1 were dropped


def test_the_feed_is_bounded_in_bytes():
    feed = FinishedFeed(max_bytes=200_000)
    for i in range(20):
        feed.add(_pull(i, blocks=8192))  # ~47 KB each once encoded
    assert feed.nbytes <= 200_000 and 1 <= len(feed) < 20
    assert _ids(feed.since(0, limit=100))[-1] == "p19"


def test_a_page_is_cut_by_bytes_but_always_carries_one_entry(monkeypatch):
    monkeypatch.setattr(finished_mod, "PAGE_BYTES", 1000)
    feed = FinishedFeed()
    for i in range(3):
        feed.add(_pull(i, blocks=8192))  # each alone is larger than a page
    page = feed.since(0, limit=100)
    assert (_ids(page), page.more) == (["p0"], True)
    assert _ids(feed.since(page.cursor, limit=100)) == ["p1"]
