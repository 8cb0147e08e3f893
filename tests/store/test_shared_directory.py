"""The file tier in a directory other sidecars write and evict: a lookup costs one stat of an
unchanged subdirectory whatever its size, still sees every change (a sibling's file made in the
same timestamp tick as the listing included), a stale listing costs a miss, never an error or
wrong bytes, and only plain files are entries (a link's target is never counted or touched)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from kvxferd.errors import PullError
from kvxferd.pattern import verify_pattern
from kvxferd.store.format import CorruptEntry
from kvxferd.store.pool import BufferPool
from kvxferd.store.tiers import SUFFIX, EntryId, FileTier
from tests.store.helpers import DENSE, block_ids, filled, keys, plan, pool, store

FP = "00112233aabbccdd"
POOL = BufferPool(free_limit=1 << 20)
SEED, TOKENS, CHUNK = 5, 32, 16


def _eid(i: int, sub: str = "ab") -> EntryId:
    return EntryId(f"{sub}{i:030x}", FP, 1, 0)


def _set_mtime(path, ns: int) -> None:  # noqa: ANN001
    os.utime(path, ns=(ns, ns))


def _hour_ago() -> int:
    return time.time_ns() - 3600 * 10**9


def _in_an_hour() -> int:
    return time.time_ns() + 3600 * 10**9


@pytest.fixture
def listings(monkeypatch):
    """The directories os.listdir and os.scandir were asked for, in order."""
    seen: list[str] = []
    listdir, scandir = os.listdir, os.scandir

    def counting_listdir(path="."):  # noqa: ANN001, ANN202
        seen.append(os.fspath(path))
        return listdir(path)

    def counting_scandir(path="."):  # noqa: ANN001, ANN202
        seen.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "listdir", counting_listdir)
    monkeypatch.setattr(os, "scandir", counting_scandir)
    return seen


def test_lookups_in_an_unchanged_subdirectory_do_not_list_it(tmp_path, listings):
    """What a 1M-entry store (~4k files per subdirectory) costs per chunk looked up: one stat,
    not a listing of every name beside the entry."""
    tier = FileTier(tmp_path, capacity=1 << 40)
    for i in range(50):
        assert tier.write(_eid(i), [bytes(10)])
    _set_mtime(tmp_path / "ab", _hour_ago())
    assert tier.writers(_eid(3).key, FP) == [_eid(3)]
    listings.clear()
    for i in range(50):
        assert tier.writers(_eid(i).key, FP) == [_eid(i)]
        assert tier.writers(_eid(100 + i).key, FP) == []
    assert listings == []


def test_a_siblings_new_file_is_found_once_it_appears(tmp_path):
    ours, sibling = FileTier(tmp_path, 1 << 40), FileTier(tmp_path, 1 << 40)
    assert ours.write(_eid(0), [bytes(10)])
    _set_mtime(tmp_path / "ab", _hour_ago())
    assert ours.writers(_eid(1).key, FP) == []  # listed, and trusted: the mtime is old
    assert sibling.write(_eid(1), [bytes(10)])
    assert ours.writers(_eid(1).key, FP) == [_eid(1)]


def test_a_siblings_file_made_in_the_listings_timestamp_tick_is_found(tmp_path):
    """The subdirectory changed in the tick the listing was made in; the sibling's file, made in
    that tick too, leaves the mtime as it was (simulated: the mtime is set back). The listing
    cannot be trusted, so the next lookup lists again."""
    ours, sibling = FileTier(tmp_path, 1 << 40), FileTier(tmp_path, 1 << 40)
    assert ours.write(_eid(0), [bytes(10)])
    tick = _in_an_hour()  # not older than the filesystem's clock when listed: the same tick
    _set_mtime(tmp_path / "ab", tick)
    assert ours.writers(_eid(1).key, FP) == []
    assert sibling.write(_eid(1), [bytes(10)])
    _set_mtime(tmp_path / "ab", tick)
    assert ours.writers(_eid(1).key, FP) == [_eid(1)]


def test_own_write_is_found_at_once_even_where_the_mtime_does_not_show_it(tmp_path):
    tier = FileTier(tmp_path, 1 << 40)
    assert tier.write(_eid(0), [bytes(10)])
    old = _hour_ago()
    _set_mtime(tmp_path / "ab", old)
    assert tier.writers(_eid(1).key, FP) == []
    assert tier.write(_eid(1), [bytes(10)])
    _set_mtime(tmp_path / "ab", old)
    assert tier.writers(_eid(1).key, FP) == [_eid(1)]


def _saved(root):  # noqa: ANN001, ANN202
    """A dense prompt of two chunks saved by a sibling's store; (manifest, entry files)."""
    m = plan(DENSE, blocks=6)
    regions, ids = filled(m, TOKENS, SEED)
    sibling = store(root, CHUNK)
    sibling.save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    sibling.close()
    files = sorted(root.rglob(f"*{SUFFIX}"))
    assert len(files) == 2
    return m, files


def _unseen(path, change) -> None:  # noqa: ANN001
    """``change()`` to a file, its subdirectory's mtime left as it was (what a listing in the
    same tick, or a filesystem with coarser times, would not see)."""
    mtime = path.parent.stat().st_mtime_ns
    change()
    _set_mtime(path.parent, mtime)


def _trusted_lookup(root, m):  # noqa: ANN001, ANN202
    """A store that looked the whole prompt up, its listings old enough to be trusted."""
    for sub in {p.parent for p in root.rglob(f"*{SUFFIX}")}:
        _set_mtime(sub, _hour_ago())
    s = store(root, CHUNK, dram=0)
    assert s.lookup(m, keys(TOKENS, CHUNK), TOKENS).matched == TOKENS
    return s


def test_a_siblings_eviction_the_listing_missed_is_a_miss_then_no_longer_offered(tmp_path):
    m, files = _saved(tmp_path)
    s = _trusted_lookup(tmp_path, m)
    _unseen(files[1], files[1].unlink)
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_miss"
    assert s.lookup(m, keys(TOKENS, CHUNK), TOKENS).matched < TOKENS


def test_a_load_that_meets_a_link_drops_the_link_and_keeps_its_target(tmp_path):
    """Listed as a plain file, then replaced by a link (to the entry's own bytes, moved away):
    the load fails store_corrupt and removes the link; the file it pointed at is untouched."""
    m, files = _saved(tmp_path)
    s = _trusted_lookup(tmp_path, m)
    target = tmp_path / "elsewhere"
    _unseen(files[1], lambda: (files[1].rename(target), files[1].symlink_to(target)))
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt"
    assert not files[1].is_symlink() and not files[1].exists()
    assert target.stat().st_size > 0 and s.files.stats.corrupt == 1


def test_a_save_replaces_a_link_under_an_entry_name_so_the_prefix_loads_again(tmp_path):
    m, files = _saved(tmp_path)
    last = next(f for f in files if f.name.startswith(keys(TOKENS, CHUNK)[1]))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not an entry")
    last.unlink()
    last.symlink_to(target)
    regions, ids = filled(m, TOKENS, SEED)
    s = store(tmp_path, CHUNK, dram=0)
    assert s.lookup(m, keys(TOKENS, CHUNK), TOKENS).matched == CHUNK
    assert s.save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS).chunks_saved == 1
    assert not last.is_symlink() and target.read_bytes() == b"not an entry"
    loader, ids = store(tmp_path, CHUNK, dram=0), block_ids(m, TOKENS)
    regions = pool(m)
    loader.load(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    assert verify_pattern(m, regions, ids, SEED) is None


def test_a_link_under_an_entry_name_is_neither_counted_nor_offered(tmp_path):
    """A link to a large file would count the file's size against the disk budget (and get
    other entries evicted); it is no entry at all."""
    target = tmp_path / "large"
    with open(target, "wb") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    root = tmp_path / "store"
    (root / "ab").mkdir(parents=True)
    (root / "ab" / _eid(0).filename).symlink_to(target)
    tier = FileTier(root, capacity=1 << 40)
    assert tier.stats.bytes == 0 and tier.stats.entries == 0
    assert tier.writers(_eid(0).key, FP) == [] and not tier.has(_eid(0))
    assert tier.stats.bytes == 0 and target.stat().st_size == 1 << 30


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_reading_a_name_that_is_no_plain_file_is_corrupt_and_drop_removes_only_the_name(
    tmp_path, kind
):
    tier = FileTier(tmp_path, capacity=1 << 40)
    path = tier.path(_eid(0))
    path.parent.mkdir()
    target = tmp_path / "target"
    target.write_bytes(b"someone's file")
    if kind == "link":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    with pytest.raises(CorruptEntry):
        tier.read(_eid(0), POOL.take, max_size=1 << 20)
    tier.drop(_eid(0), corrupt=True)
    assert not os.path.lexists(path) and target.read_bytes() == b"someone's file"


def test_where_the_clock_file_cannot_be_set_every_lookup_lists_and_stays_right(tmp_path, listings):
    (tmp_path / ".clock").mkdir()  # no file to set: the filesystem's time is unknown
    ours, sibling = FileTier(tmp_path, 1 << 40), FileTier(tmp_path, 1 << 40)
    assert ours.write(_eid(0), [bytes(10)])
    old = _hour_ago()
    _set_mtime(tmp_path / "ab", old)
    listings.clear()
    assert ours.writers(_eid(1).key, FP) == []
    assert sibling.write(_eid(1), [bytes(10)])
    _set_mtime(tmp_path / "ab", old)  # what an unseen clock could not rule out
    assert ours.writers(_eid(1).key, FP) == [_eid(1)]
    assert listings == [str(tmp_path / "ab")] * 2


def test_a_directory_under_an_entry_name_is_corrupt_when_read_left_by_drop_and_never_offered(
    tmp_path,
):
    tier = FileTier(tmp_path, capacity=1 << 40)
    path = tier.path(_eid(0))
    path.mkdir(parents=True)
    with pytest.raises(CorruptEntry):
        tier.read(_eid(0), POOL.take, max_size=1 << 20)
    tier.drop(_eid(0), corrupt=True)  # cannot be removed: logged, not raised into the load
    assert path.is_dir() and tier.writers(_eid(0).key, FP) == [] and not tier.has(_eid(0))


def test_a_subdirectory_that_is_a_link_is_never_written_read_or_deleted_in(tmp_path):
    """``root/ab`` a link to a directory elsewhere, made before the tier looks or swapped in
    after a lookup offered its entry: an engine's key starting ``ab`` reaches nothing there."""
    root, elsewhere, moved = tmp_path / "store", tmp_path / "elsewhere", tmp_path / "moved"
    elsewhere.mkdir()
    theirs = elsewhere / _eid(0).filename
    theirs.write_bytes(b"someone's file")
    tier = FileTier(root, capacity=1 << 40)
    (root / "ab").symlink_to(elsewhere)
    assert not tier.write(_eid(1), [b"an entry"]) and tier.stats.write_errors == 1
    assert sorted(os.listdir(elsewhere)) == [theirs.name]
    assert tier.writers(_eid(0).key, FP) == [] and not tier.has(_eid(0))
    assert tier.read(_eid(0), POOL.take, max_size=1 << 20) is None
    tier.drop(_eid(0), corrupt=True)
    assert theirs.read_bytes() == b"someone's file"
    (root / "ab").unlink()
    assert tier.write(_eid(0), [b"ours"]) and tier.writers(_eid(0).key, FP) == [_eid(0)]
    (root / "ab").rename(moved)
    (root / "ab").symlink_to(moved)
    assert tier.read(_eid(0), POOL.take, max_size=1 << 20) is None
    tier.drop(_eid(0), corrupt=True)
    assert (moved / _eid(0).filename).read_bytes() == b"ours"


def test_an_entry_whose_time_cannot_be_set_still_loads(tmp_path):
    """A file the tier may read but not touch (a read-only mount, another's file; here an
    immutable one, which refuses even root) is served: its mtime is only an LRU hint."""
    m, files = _saved(tmp_path)
    if subprocess.run(["chattr", "+i", *map(str, files)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(PermissionError):
            os.utime(files[0])
        s = store(tmp_path, CHUNK, dram=0)
        regions, ids = pool(m), block_ids(m, TOKENS)
        assert s.load(m, regions, ids, keys(TOKENS, CHUNK), TOKENS).file_bytes > 0
        assert verify_pattern(m, regions, ids, SEED) is None
    finally:
        subprocess.run(["chattr", "-i", *map(str, files)], check=True)


def test_the_directories_a_tier_makes_are_its_owners_alone(tmp_path):
    """Entry names are prompt-prefix hashes: listable by anyone, they tell which prompts were
    served (the files themselves are 0600 already)."""
    old = os.umask(0o022)
    try:
        tier = FileTier(tmp_path / "store", capacity=1 << 20)
        assert tier.write(_eid(0), [b"an entry"])
    finally:
        os.umask(old)
    for made in (tmp_path / "store", tmp_path / "store" / "ab"):
        assert made.stat().st_mode & 0o077 == 0, oct(made.stat().st_mode)
