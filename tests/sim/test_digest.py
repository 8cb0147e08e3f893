"""The request digest depends on the KV bytes only: not on block ids, not on the TP layout."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest, request_blocks
from kvxferd.pattern import write_pattern
from kvxferd.sim.digest import rank_digest, request_digest

NUM_BLOCKS = 16


def _engine(config: str, tp: int, **options: object):
    hf = load_hf_config(config)
    manifests = [
        plan_manifest(hf, PlanOptions(tp_size=tp, tp_rank=r, num_blocks=NUM_BLOCKS, **options))
        for r in range(tp)
    ]
    regions = [[np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions] for m in manifests]
    return manifests, regions


def _ids(manifest, tokens: int, order: list[int]) -> list[list[int]]:
    need = request_blocks(manifest, tokens)
    out, start = [], 0
    for n in need:
        out.append(order[start : start + n])
        start += n
    return out


@pytest.mark.parametrize(
    ("config", "options"),
    [("granite-4.0-h-tiny", {}), ("llama-3.1-8b", {}), ("qwen3-next-80b-a3b", {}),
     ("granite-4.0-h-tiny", {"conv_layout": "SD"}), ("qwen3-next-80b-a3b", {"conv_layout": "SD"})],
    ids=["mamba2-hybrid", "dense", "gdn-hybrid", "mamba2-hybrid-sd", "gdn-hybrid-sd"],
)  # fmt: skip
def test_same_bytes_give_the_same_digest_whatever_the_block_ids_and_tp(config, options):
    tokens = 40
    m1, r1 = _engine(config, 1, **options)
    m2, r2 = _engine(config, 2, **options)
    ids_a = _ids(m1[0], tokens, list(range(1, NUM_BLOCKS)))
    ids_b = _ids(m1[0], tokens, list(range(NUM_BLOCKS - 1, 0, -1)))
    for m, r in zip(m1, r1, strict=True):
        write_pattern(m, r, ids_a, seed=5)
    for m, r in zip(m2, r2, strict=True):
        write_pattern(m, r, ids_b, seed=5)
    d1 = request_digest(m1, r1, ids_a)
    assert d1 == request_digest(m2, r2, ids_b)
    assert d1 != 0
    # A different request's bytes give a different digest.
    for m, r in zip(m1, r1, strict=True):
        write_pattern(m, r, ids_a, seed=6)
    assert request_digest(m1, r1, ids_a) != d1


def test_one_changed_byte_changes_the_digest_and_bytes_outside_do_not():
    (m,), (regions,) = _engine("granite-4.0-h-tiny", 1)
    ids = _ids(m, 30, list(range(1, NUM_BLOCKS)))
    write_pattern(m, regions, ids, seed=9)
    before = rank_digest(m, regions, ids)
    unused = max(b for g in ids for b in g) + 1
    page = m.regions[0].page_bytes
    regions[0][unused * page : (unused + 1) * page] ^= 0xFF  # a block not in the request
    assert rank_digest(m, regions, ids) == before
    attn = next(g for g in m.groups if g.kind != "mamba").layers[0]
    gi = next(i for i, g in enumerate(m.groups) if g.kind != "mamba")
    where = attn.v.offset + ids[gi][0] * attn.v.block_stride + 3
    regions[attn.region][where] ^= 0x01  # one bit of one V byte of the request
    assert rank_digest(m, regions, ids) != before


def test_replicated_heads_count_once_so_tp_beyond_the_head_count_agrees():
    # llama-3.1-8b has 8 KV heads: at TP 16 every head is replicated on two ranks.
    tokens = 20
    m1, r1 = _engine("llama-3.1-8b", 1)
    m8, r8 = _engine("llama-3.1-8b", 16)
    ids = _ids(m1[0], tokens, list(range(1, NUM_BLOCKS)))
    for m, r in [*zip(m1, r1, strict=True), *zip(m8, r8, strict=True)]:
        write_pattern(m, r, ids, seed=3)
    assert request_digest(m1, r1, ids) == request_digest(m8, r8, ids)
