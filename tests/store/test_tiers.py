"""Tier bounds: the DRAM pool and the file directory never hold more than their capacity, evict
least recently used first, and the file tier rebuilds its view from disk after a restart."""

from __future__ import annotations

import os
import time

import pytest

from kvxferd.errors import StoreError
from kvxferd.store import store as store_mod
from kvxferd.store.format import CorruptEntry, Header
from kvxferd.store.pool import BufferPool, size_class
from kvxferd.store.tiers import (
    STALE_TMP_S,
    Cached,
    DramTier,
    EntryId,
    FileTier,
    parse_filename,
)
from tests.store.helpers import DENSE, filled, keys, plan, store


def _eid(i: int) -> EntryId:
    return EntryId(f"{i:032x}", "00112233aabbccdd", 2, 1)


POOL = BufferPool(free_limit=1 << 20)


def _cached(size: int, pool: BufferPool = POOL) -> Cached:
    header = Header(key="0" * 32, group_fp="0" * 16, kind="mamba", chunk=0, tokens=1,
                    writer_tp_size=1, writer_tp_rank=0, writer_block_size=1,
                    writer_kernel_block_size=1, sections=[])  # fmt: skip
    return Cached(header, [], size, pool.take(size))


def test_entry_file_names_round_trip():
    eid = _eid(7)
    assert parse_filename(eid.filename) == eid
    assert parse_filename("junk.kvx") is None and parse_filename(eid.filename + ".tmp") is None


def test_dram_pool_is_bounded_and_lru():
    capacity = 3 * size_class(100)
    tier = DramTier(capacity)
    for i in range(3):
        assert tier.put(_eid(i), _cached(100))
    assert tier.get(_eid(0)) is not None  # 0 is now the most recently used
    assert tier.put(_eid(3), _cached(100))
    assert tier.stats.bytes <= capacity and tier.stats.evictions == 1
    assert tier.has(_eid(0)) and not tier.has(_eid(1)) and tier.has(_eid(3))
    assert not tier.put(_eid(4), _cached(capacity + 1))  # never fits: refused, none evicted
    assert tier.stats.entries == 3


def test_dram_capacity_bounds_the_memory_held_not_the_entry_bytes():
    """An entry of 64 KiB + 1 byte keeps an 80 KiB buffer: a tier for four such entries'
    bytes holds three, and reports the buffers' bytes."""
    entry = (64 << 10) + 1
    held = size_class(entry)
    assert held > entry * 1.2
    tier = DramTier(capacity=4 * entry)
    entries = [_cached(entry) for _ in range(4)]
    for i, cached in enumerate(entries):
        assert tier.put(_eid(i), cached)
    kept = [c for i, c in enumerate(entries) if tier.has(_eid(i))]
    assert len(kept) == 3 and tier.stats.evictions == 1
    assert tier.stats.bytes == sum(c.buffer.array.nbytes for c in kept) == 3 * held
    assert tier.stats.bytes <= tier.capacity


def test_size_classes_waste_at_most_a_quarter():
    for n in (1, 65536, 65537, 100_000, 1 << 20, (1 << 20) + 1, 3_000_000, 123_456_789):
        c = size_class(n)
        assert c >= n and (n <= 65536 or c <= n * 1.25)


def test_evicted_buffer_is_reused_only_after_its_last_reader():
    pool = BufferPool(free_limit=1 << 30)
    tier = DramTier(capacity=150_000)
    first = _cached(100_000, pool)
    tier.put(_eid(0), first)
    first.buffer.release()  # the saver's reference: now only the tier holds it
    reading = tier.get(_eid(0))  # a load scattering from it
    assert reading is first
    tier.put(_eid(1), _cached(100_000, pool))  # evicts entry 0 while it is being read
    assert not tier.has(_eid(0))
    assert pool.free_bytes == 0  # still in use: not handed out again
    reading.buffer.release()
    assert pool.free_bytes == size_class(100_000)
    again = pool.take(100_000)
    assert again.array is first.buffer.array and pool.allocated == 2  # reused, not allocated


def test_free_buffers_are_bounded():
    pool = BufferPool(free_limit=200_000)
    buffers = [pool.take(100_000) for _ in range(3)]
    for b in buffers:
        b.release()
    assert pool.free_bytes <= 200_000


def test_file_tier_is_bounded_and_lru(tmp_path):
    tier = FileTier(tmp_path, capacity=250)
    for i in range(2):
        assert tier.write(_eid(i), [bytes(100)])
    buf, n = tier.read(_eid(0), POOL.take, max_size=100)  # touch 0
    assert n == 100 and not buf.array[:n].any()
    buf.release()
    assert tier.write(_eid(2), [bytes(100)])
    assert tier.stats.bytes <= 250 and tier.stats.evictions == 1
    assert tier.has(_eid(0)) and not tier.has(_eid(1)) and tier.has(_eid(2))
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kvx")) <= 250
    assert not tier.write(_eid(2), [bytes(100)])  # present: not rewritten


def test_file_tier_restart_evicts_oldest_to_a_smaller_budget(tmp_path):
    tier = FileTier(tmp_path, capacity=1000)
    for i in range(5):
        tier.write(_eid(i), [bytes(100)])
        tier.read(_eid(i), POOL.take, max_size=100)[0].release()  # mtime order = write order
    smaller = FileTier(tmp_path, capacity=250)
    assert smaller.stats.bytes == 200 and smaller.stats.entries == 2
    assert [e for e in map(_eid, range(5)) if smaller.has(e)] == [_eid(3), _eid(4)]


def test_file_tier_is_bounded_in_files_too_and_evicts_lru(tmp_path):
    """A flood of tiny entries stays within the byte budget but not the disk's inodes or the
    index's memory: the file count has its own bound, evicting as the bytes do."""
    tier = FileTier(tmp_path, capacity=1 << 20, max_entries=2)
    for i in range(2):
        assert tier.write(_eid(i), [bytes(10)])
    tier.read(_eid(0), POOL.take, max_size=10)[0].release()  # touch 0
    assert tier.write(_eid(2), [bytes(10)])
    assert tier.stats.entries == 2 and tier.stats.evictions == 1
    assert [tier.has(_eid(i)) for i in range(3)] == [True, False, True]
    assert len(list(tmp_path.rglob("*.kvx"))) == 2
    assert not FileTier(tmp_path / "none", capacity=1 << 20, max_entries=0).write(_eid(0), [b"x"])


def test_file_tier_restart_evicts_oldest_to_a_smaller_file_count(tmp_path):
    tier = FileTier(tmp_path, capacity=1 << 20)
    for i in range(5):
        tier.write(_eid(i), [bytes(10)])
        tier.read(_eid(i), POOL.take, max_size=10)[0].release()  # mtime order = write order
    fewer = FileTier(tmp_path, capacity=1 << 20, max_entries=2)
    assert fewer.stats.entries == 2 and len(list(tmp_path.rglob("*.kvx"))) == 2
    assert [e for e in map(_eid, range(5)) if fewer.has(e)] == [_eid(3), _eid(4)]


def test_file_over_the_callers_bound_is_corrupt_and_never_allocated(tmp_path):
    """A file grown or planted under an entry's name (the directory may be shared) must not
    size the sidecar's memory: refused before any buffer is taken for it."""
    tier = FileTier(tmp_path, capacity=1 << 20)
    assert tier.write(_eid(0), [bytes(100)])
    with open(tier.path(_eid(0)), "r+b") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    taken: list[int] = []

    def alloc(n: int):  # noqa: ANN202
        taken.append(n)
        return POOL.take(n)

    with pytest.raises(CorruptEntry):
        tier.read(_eid(0), alloc, max_size=100)
    assert taken == []
    tier.path(_eid(0)).write_bytes(bytes(100))
    buf, n = tier.read(_eid(0), alloc, max_size=100)  # at the bound: read
    buf.release()
    assert n == 100 and taken == [100]


@pytest.mark.parametrize("dram", [0, 1 << 20])
def test_store_stays_within_both_budgets(tmp_path, dram):
    m = plan(DENSE, blocks=10)
    chunk, tokens = 16, 128  # 8 chunks of 1 MiB each
    regions, ids = filled(m, tokens, seed=3)
    s = store(tmp_path, chunk, dram=dram, files=3 << 20)
    out = s.save(m, regions, ids, keys(tokens, chunk), tokens)
    assert out.chunks_saved == 8
    assert s.dram.stats.bytes <= dram and s.files.stats.bytes <= 3 << 20
    assert s.files.stats.evictions >= 5
    # the leading chunks were evicted first, so nothing matches from the start
    assert s.lookup(m, keys(tokens, chunk), tokens).matched == 0


def test_store_memory_is_its_dram_capacity_plus_staging(tmp_path, monkeypatch):
    """One-token entries (another size class) replace full chunks in the DRAM tier: the evicted
    buffers the pool keeps free and the tier's together stay within the DRAM capacity plus
    STAGING_BYTES (the entries in flight come and go with the calls)."""
    monkeypatch.setattr(store_mod, "STAGING_BYTES", 1 << 20)
    m = plan(DENSE, blocks=10)
    dram = 8 << 20
    s = store(tmp_path, 16, dram=dram)
    regions, ids = filled(m, 64, seed=3)
    s.save(m, regions, ids, keys(64, 16), 64)  # 4 chunks of 2 MiB: the tier holds 3
    for i in range(80):
        s.save(m, regions, [ids[0][:1]], keys(1, 16, salt=bytes([i])), 1)  # 128 KiB each
    s.close()
    assert s.dram.stats.evictions >= 4
    assert s.dram.stats.bytes + s.pool.free_bytes <= dram + (1 << 20)


def test_start_removes_only_the_stores_own_temporaries(tmp_path):
    """A store directory set to a shared place (or holding a link) never costs anyone else's
    files: only ``<key[:2]>/<entry>.<pid>.<hex>.tmp`` names are leftovers of a crash."""
    root, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    (root / "projects").mkdir(parents=True)
    elsewhere.mkdir()
    foreign = [root / "projects" / "build.tmp", elsewhere / "notes.tmp"]
    (root / "ab").symlink_to(elsewhere)
    ours = root / "00" / f"{_eid(0).filename}.123.abcd.tmp"
    ours.parent.mkdir()
    for f in [*foreign, ours, root / "00" / "other.tmp"]:
        f.write_bytes(b"x")
        _age(f, STALE_TMP_S + 60)
    tier = FileTier(root, capacity=1 << 20)
    assert not ours.exists() and tier.stats.partial_removed == 1
    assert all(f.exists() for f in foreign) and (root / "00" / "other.tmp").exists()


def _age(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_start_keeps_a_temporary_a_sibling_may_still_be_writing(tmp_path):
    """Sidecars may share a directory: a young temporary is another one's write in progress
    (removing it would fail that save); only one older than any write takes is a leftover."""
    live = tmp_path / "00" / f"{_eid(0).filename}.77.beef.tmp"
    stale = tmp_path / "00" / f"{_eid(1).filename}.78.cafe.tmp"
    live.parent.mkdir()
    live.write_bytes(b"x")
    stale.write_bytes(b"x")
    _age(live, STALE_TMP_S - 60)
    _age(stale, STALE_TMP_S + 60)
    tier = FileTier(tmp_path, capacity=1 << 20)
    assert live.exists() and not stale.exists() and tier.stats.partial_removed == 1


def test_start_skips_an_entry_a_sibling_evicts_while_it_scans(tmp_path, monkeypatch):
    """Sidecars may share a directory: a file listed, then deleted by another one's eviction
    before it is stat()ed, is not indexed, and the store starts."""
    first = FileTier(tmp_path, capacity=1 << 20)
    assert first.write(_eid(0), [bytes(100)]) and first.write(_eid(1), [bytes(100)])
    listed = os.scandir

    def scandir(path):  # noqa: ANN001, ANN202
        with listed(path) as entries:
            for entry in entries:
                if entry.name == _eid(0).filename:
                    os.unlink(entry.path)  # the sibling's eviction, between listing and stat
                yield entry

    monkeypatch.setattr(os, "scandir", scandir)
    tier = FileTier(tmp_path, capacity=1 << 20)
    assert tier.stats.entries == 1 and tier.stats.bytes == 100
    assert not tier.has(_eid(0)) and tier.has(_eid(1))


def test_only_names_the_store_writes_are_entries():
    assert parse_filename(f"..-{'0' * 16}-t1r0.kvx") is None  # would name a path outside root
    assert parse_filename(f"{'a' * 32}-{'0' * 16}-t0r0.kvx") is None
    assert parse_filename(f"{'A' * 32}-{'0' * 16}-t1r0.kvx") is None


@pytest.mark.parametrize("field", ["store_dram_bytes", "store_file_bytes", "store_file_entries"])
def test_a_negative_capacity_is_refused_naming_its_own_field(tmp_path, field: str):
    sizes = {"store_dram_bytes": 0, "store_file_bytes": 0, "store_file_entries": 0, field: -1}
    with pytest.raises(StoreError) as err:
        store_mod.Store(str(tmp_path), 16, sizes["store_dram_bytes"], sizes["store_file_bytes"],
                        file_entries=sizes["store_file_entries"])  # fmt: skip
    assert err.value.field == field


def test_the_configs_default_file_count_is_the_stores():
    from kvxferd.config import Config
    from kvxferd.store.tiers import FILE_ENTRIES

    assert Config().store_file_entries == FILE_ENTRIES
