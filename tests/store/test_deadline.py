"""A store load is bounded: past its deadline it stops before the next chunk and fails with
``deadline``, so whoever waits for its answer knows nothing more is written after it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvxferd.errors import PullError
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
