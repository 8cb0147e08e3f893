"""vLLM 0.33's packed K|V layout (a head's K and V rows interleaved per token) saves and loads
byte-exact: saved by TP 2 with kernel blocks of 4, loaded at TP 1 with kernel blocks of 8."""

from __future__ import annotations

import numpy as np

from kvxferd.pattern import token_footprint, verify_token_pattern, write_token_pattern
from tests.descriptors.layouts import AttnSpec, render_packed
from tests.store.helpers import keys, pool, store

SEED, CHUNK, TOKENS = 9, 16, 37


def _ids(first: int, blocks: int) -> list[list[int]]:
    return [list(range(first, first + blocks))]


def test_packed_kv_saved_at_tp2_loads_at_tp1_byte_exact(tmp_path):
    a = AttnSpec(total_heads=4, head_size=8, dtype="bfloat16", kbs=4, ratio=2, head_layout="HND")
    s = store(tmp_path, CHUNK)
    try:
        for rank in range(2):
            m = render_packed(a, 2, 12, tp=2, rank=rank)
            regions, ids = pool(m), _ids(2, 5)
            write_token_pattern(m, regions, ids, TOKENS, SEED)
            assert s.save(m, regions, ids, keys(TOKENS, CHUNK), TOKENS).chunks_saved == 3
        reader = render_packed(AttnSpec(**{**a.__dict__, "kbs": 8, "ratio": 1}), 2, 12)
        regions, ids = pool(reader), _ids(6, 5)
        for r in regions:
            r[:] = 0xA5
        assert s.lookup(reader, keys(TOKENS, CHUNK), TOKENS).matched == TOKENS
        s.load(reader, regions, ids, keys(TOKENS, CHUNK), TOKENS)
        assert verify_token_pattern(reader, regions, ids, TOKENS, SEED) is None
        touched = token_footprint(reader, ids, TOKENS)
        assert all((r[~t] == 0xA5).all() for r, t in zip(regions, touched, strict=True))
        assert sum(int(np.count_nonzero(t)) for t in touched) == 2 * 2 * 4 * TOKENS * 16
    finally:
        s.close()
