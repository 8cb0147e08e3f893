"""A store load is bounded: past its deadline it stops before the next chunk and fails with
``deadline`` (``cancelled`` once it is told to stop), so whoever waits for its answer knows
nothing more is written after it. A guard that refuses (the engine's memory was truncated)
stops a load or a save before the next entry touches the regions."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvxferd.errors import PullError, SegmentTooSmallError
from tests.store.helpers import MAMBA2, block_ids, filled, keys, plan, pool, store

SEED = 5
CHUNK = 32


def test_a_load_past_its_deadline_fails_with_deadline_and_writes_nothing(tmp_path):
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    store(tmp_path, CHUNK).save(m, regions, ids, keys(tokens, CHUNK), tokens)
    dest, fresh = pool(m), block_ids(m, tokens)
    with pytest.raises(PullError) as err:
        store(tmp_path, CHUNK).load(m, dest, fresh, keys(tokens, CHUNK), tokens,
                                    stop_at=time.monotonic() - 1.0)  # fmt: skip
    assert err.value.reason == "deadline"
    assert all(not np.any(r) for r in dest)  # stopped before the first chunk: nothing written
    out = store(tmp_path, CHUNK).load(m, dest, fresh, keys(tokens, CHUNK), tokens,
                                      stop_at=time.monotonic() + 600)  # fmt: skip
    assert out.tokens == tokens


def test_a_read_that_outlasts_the_deadline_writes_nothing(tmp_path, monkeypatch):
    """The deadline passes while an entry is read (a slow disk, a queue of other loads' reads):
    its bytes are not scattered, since the caller may already have given the blocks back."""
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    store(tmp_path, CHUNK).save(m, regions, ids, keys(tokens, CHUNK), tokens)
    clock = [0.0]
    fake = SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr("kvxferd.store.store.time", fake)
    s = store(tmp_path, CHUNK)
    read = s.files.read

    def slow_read(eid, alloc, max_size):  # noqa: ANN001, ANN202
        clock[0] += 10.0  # this read takes longer than the whole load may
        return read(eid, alloc, max_size)

    s.files.read = slow_read
    dest = pool(m)
    with pytest.raises(PullError) as err:
        s.load(m, dest, block_ids(m, tokens), keys(tokens, CHUNK), tokens, stop_at=5.0)
    assert err.value.reason == "deadline"
    assert all(not np.any(r) for r in dest)


def test_a_save_keeps_no_entry_whose_copy_ended_past_its_deadline(tmp_path, monkeypatch):
    """The engine frees the blocks once the save's ``stop_at`` passes: an entry copied across it
    may hold another request's KV, so it is dropped (the copies before it are kept)."""
    m = plan(MAMBA2, blocks=12)
    tokens = 2 * CHUNK
    regions, ids = filled(m, tokens, SEED)
    clock = [0.0]
    fake = SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr("kvxferd.store.store.time", fake)
    s = store(tmp_path, CHUNK)
    copies = [0]

    def copied() -> None:  # after each entry's copy: the second one outlasts the deadline
        copies[0] += 1
        clock[0] += 10.0 if copies[0] == 2 else 0.0

    out = s.save(m, regions, ids, keys(tokens, CHUNK), tokens, kept=copied, stop_at=5.0)
    assert (out.cut, out.chunks_saved, copies[0]) == ("deadline", 1, 2)
    assert s.files.stats.entries == 1  # before: 2, the second copied from freed blocks


def test_a_stopped_load_fails_cancelled_and_writes_nothing(tmp_path):
    """Its ``stop`` event is set (the engine unregisters): no entry is written from then on."""
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    store(tmp_path, CHUNK).save(m, regions, ids, keys(tokens, CHUNK), tokens)
    stop = threading.Event()
    stop.set()
    dest = pool(m)
    with pytest.raises(PullError) as err:
        store(tmp_path, CHUNK).load(m, dest, block_ids(m, tokens), keys(tokens, CHUNK), tokens,
                                    stop=stop)  # fmt: skip
    assert err.value.reason == "cancelled"
    assert all(not np.any(r) for r in dest)


def test_a_refusing_guard_stops_a_load_before_it_writes_and_a_save_before_it_copies(tmp_path):
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    s = store(tmp_path / "a", CHUNK)
    s.save(m, regions, ids, keys(tokens, CHUNK), tokens)

    def refuse() -> None:
        raise SegmentTooSmallError("regions[0].size_bytes", "the engine truncated it")

    dest = pool(m)
    with pytest.raises(SegmentTooSmallError):
        s.load(m, dest, block_ids(m, tokens), keys(tokens, CHUNK), tokens, guard=refuse)
    assert all(not np.any(r) for r in dest)
    assert s.load(m, dest, block_ids(m, tokens), keys(tokens, CHUNK), tokens).tokens == tokens
    other = store(tmp_path / "b", CHUNK)
    with pytest.raises(SegmentTooSmallError):
        other.save(m, regions, ids, keys(tokens, CHUNK), tokens, guard=refuse)
    assert other.lookup(m, keys(tokens, CHUNK), tokens).matched == 0  # nothing was copied


def test_a_save_that_fails_midway_returns_only_once_the_writes_it_started_are_over(tmp_path):
    """``kept`` refuses the third entry (the hold let the blocks go): the two entries already
    copied are still written whole, and no file write of this save runs after it raised."""
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    s = store(tmp_path, CHUNK)
    write, running, unblock = s.files.write, [], threading.Event()

    def slow_write(eid, buffers):  # noqa: ANN001, ANN202
        running.append(eid)
        unblock.wait(timeout=1.0)  # released by the test only once save() is over
        ok = write(eid, buffers)
        running.remove(eid)
        return ok

    s.files.write = slow_write
    calls = [0]

    def kept() -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise PullError("hold_expired", "the blocks were let go")

    with pytest.raises(PullError):
        s.save(m, regions, ids, keys(tokens, CHUNK), tokens, kept=kept)
    still = list(running)
    unblock.set()
    assert still == []  # without the wait, the started writes were still running here
    assert s.files.stats.entries == 2  # both started entries landed in full
