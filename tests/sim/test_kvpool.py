"""Per-rank KV pools in shared memory, and the default pool size."""

from __future__ import annotations

import os

import pytest

from kvxferd.layout import PlanOptions, load_hf_config, preset_names
from kvxferd.memory.shm import SHM_DIR
from kvxferd.sim.kvpool import (
    DEFAULT_POOL_BYTES,
    RankPool,
    block_bytes,
    default_pool_blocks,
    plan_ranks,
)


@pytest.mark.parametrize("config", preset_names())
def test_default_pool_fits_the_budget_for_every_bundled_model(config):
    hf = load_hf_config(config)
    options = PlanOptions(tp_size=2)
    blocks = default_pool_blocks(hf, options)
    manifests = plan_ranks(hf, PlanOptions(tp_size=2, num_blocks=blocks))
    assert blocks >= 2 * len(manifests[0].groups) + 1
    total = sum(r.size_bytes for m in manifests for r in m.regions)
    assert total == blocks * block_bytes(manifests)
    assert total <= DEFAULT_POOL_BYTES or blocks == 2 * len(manifests[0].groups) + 1


def test_rank_manifests_cover_every_rank_with_unique_region_names():
    hf = load_hf_config("granite-4.0-h-tiny")
    manifests = plan_ranks(hf, PlanOptions(tp_size=2, num_blocks=4, engine_id="simtest"))
    assert [m.tp_rank for m in manifests] == [0, 1]
    names = [r.name for m in manifests for r in m.regions]
    assert len(set(names)) == len(names) and all("simtest" in n for n in names)


def test_unlink_leaves_the_memory_mapped_and_close_is_idempotent(tmp_path):
    hf = load_hf_config("llama-3.1-8b")
    engine = f"simt{os.getpid()}"
    (m,) = plan_ranks(hf, PlanOptions(num_blocks=3, engine_id=engine))
    pool = RankPool(m)
    try:
        paths = [os.path.join(SHM_DIR, r.name) for r in m.regions]
        assert all(os.path.exists(p) for p in paths)
        assert [s.name for s in pool.specs()] == [r.name for r in m.regions]
        pool.unlink()
        assert not any(os.path.exists(p) for p in paths)
        pool.views[0][:4] = 7  # still writable after the names are gone
        assert pool.views[0][:4].tolist() == [7, 7, 7, 7]
    finally:
        pool.close()
        pool.close()
