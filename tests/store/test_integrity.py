"""A corrupt, truncated or half-written entry is never loaded as valid: it is deleted, counted,
and the load fails with a reason while the lookup stops offering it."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest

from kvxferd.errors import PullError
from kvxferd.layout import request_blocks
from kvxferd.pattern import verify_pattern
from kvxferd.store import format as fmt
from kvxferd.store.canonical import group_fingerprint, part_specs
from kvxferd.store.store import max_entry_bytes
from kvxferd.store.tiers import STALE_TMP_S, SUFFIX, parse_filename
from tests.store.helpers import DENSE, GDN, MAMBA2, block_ids, filled, keys, plan, pool, store

SEED, TOKENS, CHUNK = 9, 32, 16


@pytest.fixture
def saved(tmp_path):
    m = plan(DENSE, blocks=6)
    regions, ids = filled(m, TOKENS, SEED)
    store(tmp_path, CHUNK).save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    files = sorted(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) == 2
    return m, files


def _damage(path, how):  # noqa: ANN001
    data = bytearray(path.read_bytes())
    if how == "flip_payload":
        data[-100] ^= 0x01
    elif how == "flip_header":
        data[40] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "extend":
        data += b"\0"
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip_payload", "flip_header", "truncate", "extend", "empty"])
def test_damaged_file_is_refused_deleted_and_counted(tmp_path, saved, how):
    m, files = saved
    _damage(files[1], how)
    s = store(tmp_path, CHUNK)
    regions, ids = pool(m), block_ids(m, TOKENS)
    with pytest.raises(PullError) as err:
        s.load(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt"
    assert not files[1].exists() and files[0].exists()
    assert s.files.stats.corrupt == 1
    assert s.lookup(m, keys(TOKENS, CHUNK), TOKENS).matched < TOKENS


def test_undamaged_neighbour_still_loads(tmp_path, saved):
    m, files = saved
    first_chunk = [f for f in files if f.name.startswith(keys(TOKENS, CHUNK)[0])][0]
    other = [f for f in files if f != first_chunk][0]
    _damage(other, "truncate")
    s = store(tmp_path, CHUNK)
    k = keys(TOKENS, CHUNK)
    assert s.lookup(m, k, TOKENS).matched == TOKENS  # a lookup does not read payloads
    regions, ids = pool(m), block_ids(m, TOKENS)
    s.load(m, regions, ids, k[:1], CHUNK)
    ids_first = [ids[0][:1]]
    assert verify_pattern(m, regions, ids_first, SEED) is None


def test_leftover_temporary_files_are_removed_at_start(tmp_path, saved):
    """A crash's leftover: older than any write takes (a younger one may be a sibling's)."""
    _m, files = saved
    tmp = files[0].with_name(files[0].name + ".123.abcd.tmp")
    tmp.write_bytes(b"half an entry")
    past = time.time() - STALE_TMP_S - 60
    os.utime(tmp, (past, past))
    s = store(tmp_path, CHUNK)
    assert not tmp.exists()
    assert s.files.stats.partial_removed == 1


def test_entry_renamed_to_another_key_is_refused(tmp_path, saved):
    m, files = saved
    k = keys(TOKENS, CHUNK)
    victim = [f for f in files if f.name.startswith(k[0])][0]
    other = [f for f in files if f != victim][0]
    os.replace(other, victim)  # chunk 1's bytes under chunk 0's name
    s = store(tmp_path, CHUNK)
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), k[:1], CHUNK)
    assert err.value.reason == "store_corrupt"
    assert not victim.exists()


def test_missing_entry_is_a_miss_not_a_crash(tmp_path, saved):
    m, files = saved
    files[0].unlink()
    with pytest.raises(PullError) as err:
        store(tmp_path, CHUNK).load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_miss"


def test_unwritable_directory_keeps_the_entry_in_dram(tmp_path):
    """A file that cannot be written (here: the chunk's directory is a file) is counted; the
    save still answers, the DRAM tier serves the load."""
    m = plan(DENSE, blocks=6)
    regions, ids = filled(m, TOKENS, SEED)
    k = keys(TOKENS, CHUNK)
    s = store(tmp_path, CHUNK)
    for key in k:
        (tmp_path / key[:2]).write_bytes(b"not a directory")
    out = s.save(m, regions, ids, k, TOKENS)
    assert out.chunks_saved == 2 and out.file_bytes == 0 and out.dram_bytes > 0
    assert s.files.stats.write_errors == 2
    target, tids = pool(m), block_ids(m, TOKENS)
    assert s.load(m, target, tids, k, TOKENS).dram_bytes > 0
    assert verify_pattern(m, target, tids, SEED) is None
    s.close()


def test_entry_whose_sections_miss_the_units_its_name_promises_is_refused(tmp_path):
    """Rank 0's entries copied under rank 1's names (same key and group) hold heads 0-3, not
    4-7: a TP-1 load that takes heads 4-7 from them fails instead of leaving them unwritten."""
    m0 = plan(DENSE, 2, 0, blocks=6)
    regions, ids = filled(m0, TOKENS, SEED)
    store(tmp_path, CHUNK).save(m0, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    for f in list(tmp_path.rglob(f"*{SUFFIX}")):
        f.with_name(f.name.replace("t2r0", "t2r1")).write_bytes(f.read_bytes())
    m = plan(DENSE, blocks=6)
    s = store(tmp_path, CHUNK)
    assert s.lookup(m, keys(TOKENS, CHUNK), TOKENS).matched == TOKENS
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt" and s.files.stats.corrupt == 1


def test_entry_whose_units_have_another_size_is_refused_not_a_crash(tmp_path, saved):
    """Twice the units of half the bytes: sizes and checksums still agree, the units do not."""
    m, files = saved
    for f in files:
        data = f.read_bytes()
        header, start = fmt.read_header(data, len(data))
        halves = [msgspec.structs.replace(s, units=2 * s.units, unit_bytes=s.unit_bytes // 2)
                  for s in header.sections]  # fmt: skip
        head = fmt.encode_head(msgspec.structs.replace(header, sections=halves))
        f.write_bytes(head + data[start:])
    s = store(tmp_path, CHUNK)
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt"


def test_a_fifo_under_an_entry_name_is_a_miss_not_a_hang(tmp_path, saved):
    """Reading it would block an I/O thread for good (past any deadline)."""
    m, files = saved
    files[1].unlink()
    os.mkfifo(files[1])
    s = store(tmp_path, CHUNK)
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS,
                   stop_at=time.monotonic() + 5)  # fmt: skip
        except PullError as exc:
            outcome.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(timeout=30)
    try:
        assert not loader.is_alive(), "the load blocked on the FIFO"
    finally:
        if loader.is_alive():  # let the blocked read end so the test run can finish
            os.close(os.open(files[1], os.O_WRONLY | os.O_NONBLOCK))
            loader.join(timeout=30)
    assert [e.reason for e in outcome] == ["store_miss"]


def test_file_grown_past_any_entry_of_its_group_is_refused_unread(tmp_path, saved, monkeypatch):
    """Another process sharing the directory grew an entry's file to 1 GiB: the load fails
    ``store_corrupt``, the file is deleted and counted like any corrupt entry, and no buffer of
    its size is ever taken."""
    m, files = saved
    legit = files[1].stat().st_size
    with open(files[1], "r+b") as f:
        f.truncate(1 << 30)  # sparse: costs no disk
    s = store(tmp_path, CHUNK)
    taken: list[int] = []
    take = s.pool.take
    monkeypatch.setattr(s.pool, "take", lambda n: taken.append(n) or take(n))
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt"
    assert not files[1].exists() and files[0].exists() and s.files.stats.corrupt == 1
    assert max(taken, default=0) <= legit


@pytest.mark.parametrize("preset", [DENSE, MAMBA2, GDN])
@pytest.mark.parametrize(("save_tp", "load_tp"), [(1, 2), (2, 1)])
def test_every_entry_a_writer_saves_is_within_a_readers_bound(tmp_path, preset, save_tp, load_tp):
    """The bound a load reads files under never refuses an entry a writer at another TP size
    saved (the last chunk of each group is a partial one)."""
    probe = plan(preset, blocks=1)
    tokens = 2 * probe.groups[-1].block_size - 1
    blocks = sum(request_blocks(probe, tokens)) + 2
    s = store(tmp_path, CHUNK)
    for rank in range(save_tp):
        m = plan(preset, save_tp, rank, blocks)
        regions, ids = filled(m, tokens, SEED)
        s.save(m, regions, ids, keys(tokens, CHUNK), tokens)
    s.close()
    reader = plan(preset, load_tp, 0, blocks)
    bound = {}
    for g, group in enumerate(reader.groups):
        fp = group_fingerprint(reader, g, CHUNK)
        bound[fp] = max_entry_bytes(fp, group.kind, part_specs(reader, g), CHUNK)
    files = list(tmp_path.rglob(f"*{SUFFIX}"))
    assert files
    for f in files:
        assert f.stat().st_size <= bound[parse_filename(f.name).group_fp], f.name


def test_entry_that_repeats_one_part_in_place_of_another_is_refused(tmp_path):
    """Layer 0's V section replaced by a second copy of its K section: the unit count still
    matches what the entry's name promises, but V would stay unwritten under a ``done`` load."""
    m = plan(DENSE, blocks=6)
    regions, ids = filled(m, TOKENS, SEED)
    store(tmp_path, CHUNK).save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    for f in tmp_path.rglob(f"*{SUFFIX}"):
        data = f.read_bytes()
        header, start = fmt.read_header(data, len(data))
        secs, views, at = list(header.sections), [], start
        for sec in secs:
            views.append(data[at : at + sec.units * sec.unit_bytes])
            at += sec.units * sec.unit_bytes
        assert (secs[0].layer, secs[0].part, secs[1].part) == (secs[1].layer, "k", "v")
        secs[1], views[1] = secs[0], views[0]
        head = fmt.encode_head(msgspec.structs.replace(header, sections=secs))
        f.write_bytes(head + b"".join(views))
    s = store(tmp_path, CHUNK)
    with pytest.raises(PullError) as err:
        s.load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt" and s.files.stats.corrupt == 1


def test_a_failed_checksum_names_no_text_from_the_file(tmp_path, saved):
    """A part name read from a damaged or foreign header never reaches the load's answer and
    the log as it is (a line of its own there): the section is named by its place."""
    m, files = saved
    for f in files:
        data = f.read_bytes()
        header, start = fmt.read_header(data, len(data))
        bad = [msgspec.structs.replace(s, part="k\nERROR forged line", crc=s.crc ^ 1)
               for s in header.sections]  # fmt: skip
        f.write_bytes(fmt.encode_head(msgspec.structs.replace(header, sections=bad)) +
                      data[start:])  # fmt: skip
    with pytest.raises(PullError) as err:
        store(tmp_path, CHUNK).load(m, pool(m), block_ids(m, TOKENS), keys(TOKENS, CHUNK), TOKENS)
    assert err.value.reason == "store_corrupt"
    assert "\n" not in err.value.detail and "forged" not in err.value.detail, err.value.detail
