"""Sliding-window groups in the store: their block lists cover the request's last blocks (as in
pulls); only chunks whose blocks are held are saved; a prefix is served when the window before
its next token is stored; a load writes just the window's blocks, byte-exact, nothing else."""

from __future__ import annotations

import numpy as np

from kvxferd.pattern import write_pattern
from tests.store.helpers import block_ids, filled, keys, plan, pool, store

SW = "gpt-oss-20b"  # 12 sliding-window layers (window 128, blocks of 16) + 12 full attention
SEED = 77
CHUNK = 32
TOKENS = 320  # 20 blocks: the window group's list holds the last 10 (tokens 160..319)


def test_the_window_saved_loads_byte_exact_after_a_restart_and_nothing_else_is_written(tmp_path):
    m = plan(SW, blocks=48)
    sw = next(g for g, gr in enumerate(m.groups) if gr.kind == "sliding_window")
    regions, ids = filled(m, TOKENS, SEED)
    assert len(ids[sw]) == 10
    saved = store(tmp_path, CHUNK).save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    assert saved.chunks_saved == 10 + 5  # full attention: all 10; the window group: 160..319

    s = store(tmp_path, CHUNK)  # a fresh process: nothing in DRAM
    hit = s.lookup(m, keys(TOKENS, CHUNK), TOKENS)
    assert hit.matched == TOKENS and not hit.disagree
    fresh = block_ids(m, TOKENS)  # other ids than the save's
    dest = pool(m)
    out = s.load(m, dest, fresh, keys(TOKENS, CHUNK), TOKENS)
    assert out.kv_bytes > 0 and out.state_bytes == 0
    # The load needs tokens 192..319 of the window group: its first two listed blocks (160..191)
    # are not written. Every byte of every region equals the pattern in exactly the blocks the
    # load had to write, and zero everywhere else.
    want = [list(x) for x in fresh]
    want[sw][:2] = [-1, -1]
    expected = pool(m)
    write_pattern(m, expected, want, SEED)
    for got, ref in zip(dest, expected, strict=True):
        assert np.array_equal(got, ref)


def test_a_prefix_whose_window_was_not_saved_is_not_served(tmp_path):
    m = plan(SW, blocks=48)
    regions, ids = filled(m, TOKENS, SEED)
    s = store(tmp_path, CHUNK)
    s.save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS)
    # The first 128 tokens are stored for full attention, but their window had left the
    # engine before the save: the store cannot serve them.
    short = 128
    hit = s.lookup(m, keys(short, CHUNK), short)
    assert hit.matched == 0 and hit.disagree
    assert hit.per_group == [0, short]
