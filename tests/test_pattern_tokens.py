"""The token pattern: bytes named by token, so sides with different block sizes agree.

A plan is applied in-process (numpy copies of each descriptor) between pools of planned
manifests; the decode's pool must then verify, and only its footprint may have changed.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from kvxferd import pattern
from kvxferd.descriptors import plan_pull, read_geometry
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import (
    token_digest,
    token_footprint,
    verify_token_pattern,
    write_token_pattern,
)
from kvxferd.store.canonical import fill_tokens, gather_attention, part_bytes, part_specs, token_map
from kvxferd.wire import Manifest
from tests.descriptors.layouts import AttnSpec, hybrid_spec, render, render_packed


def _plan(name: str, **opts) -> Manifest:
    return plan_manifest(load_hf_config(name), PlanOptions(num_blocks=24, **opts))


def _pool(m: Manifest) -> list[np.ndarray]:
    return [np.full(r.size_bytes, 0xA5, dtype=np.uint8) for r in m.regions]


def _ids(m: Manifest, tokens: int, first: int) -> list[list[int]]:
    out, nxt = [], first
    for g in m.groups:
        k = 1 if g.kind == "mamba" else -(-tokens // g.block_size)
        out.append(list(range(nxt, nxt + k)))
        nxt += k
    return out


def _apply(plan, local: list[np.ndarray], remote: list[np.ndarray]) -> None:
    for lr, lo, rr, ro, n in zip(plan.local_region, plan.local_offset, plan.remote_region,
                                 plan.remote_offset, plan.length, strict=True):  # fmt: skip
        local[lr][lo : lo + n] = remote[rr][ro : ro + n]


@pytest.mark.parametrize(
    ("name", "prefill", "decode"),
    [
        ("falcon-h1-0.5b", {"tp_size": 4}, {}),
        ("qwen3-next-80b-a3b", {"attn_pack_size": 4}, {}),
        ("llama-3.1-8b", {"block_size": 16}, {"block_size": 32}),
    ],
)
def test_a_re_blocked_pull_verifies_and_writes_only_the_tokens(name, prefill, decode):
    _pull_verifies_and_writes_only_the_tokens(name, prefill, decode)


@pytest.mark.parametrize(
    ("name", "prefill", "decode"),
    [
        ("llama-3.1-8b", {"tp_size": 2}, {}),
        ("llama-3.1-8b", {}, {"tp_size": 2, "tp_rank": 1}),
        ("gpt-oss-20b", {"tp_size": 2}, {}),
        ("granite-4.0-h-tiny", {"tp_size": 2}, {}),
    ],
)
def test_a_tp_sliced_pull_of_packed_nhd_heads_verifies_and_writes_only_the_tokens(
    name, prefill, decode
):
    """vLLM's packed K|V in NHD: a head is its own rows, so ranks read each other's heads."""
    nhd = {"head_layout": "NHD"}
    _pull_verifies_and_writes_only_the_tokens(name, {**prefill, **nhd}, {**decode, **nhd})


def _pull_verifies_and_writes_only_the_tokens(name: str, prefill: dict, decode: dict) -> None:
    tp = prefill.get("tp_size", 1)
    remotes = [_plan(name, **{**prefill, "tp_rank": r}) for r in range(tp)]
    local = _plan(name, **decode)
    n = max(g.block_size for g in local.groups) + 5
    rids, lids = _ids(remotes[0], n, 1), _ids(local, n, 2)
    lpool = _pool(local)
    before = [a.copy() for a in lpool]
    assert verify_token_pattern(local, lpool, lids, n, seed=7) is not None
    for remote in remotes:
        rpool = _pool(remote)
        write_token_pattern(remote, rpool, rids, n, seed=7)
        _apply(plan_pull(read_geometry(local, remote), lids, rids, -1, n), lpool, rpool)
    assert verify_token_pattern(local, lpool, lids, n, seed=7) is None
    mask = token_footprint(local, lids, n)
    for b, a, m in zip(before, lpool, mask, strict=True):
        assert not ((b != a) & ~m).any()
    # one wrong byte is found, named by part and block
    r = next(i for i, m in enumerate(mask) if m.any())
    at = int(np.flatnonzero(mask[r])[-1])
    lpool[r][at] ^= 0xFF
    bad = verify_token_pattern(local, lpool, lids, n, seed=7)
    assert bad is not None and bad.address == at and bad.region == r


@pytest.mark.parametrize("prefill_packed", [True, False])
def test_packed_kv_rows_name_the_same_token_bytes_as_unpacked_heads(prefill_packed):
    # vLLM 0.33 packs K|V per token ([blocks, heads, tokens, head_size + head_size_v]): a head's
    # K is one row per token. Re-blocked against an unpacked side, the pattern still agrees.
    a = AttnSpec(total_heads=2, head_size=4, dtype="bfloat16", kbs=4, ratio=2, head_layout="HND")
    packed = render_packed(a, 2, 12)
    spec = replace(hybrid_spec(), mamba=None, mamba_groups=(), attn_groups=(2,),
                   attn=replace(a, kbs=8, ratio=1))  # fmt: skip
    unpacked = render(spec, num_blocks=12)
    remote, local = (packed, unpacked) if prefill_packed else (unpacked, packed)
    n = 21
    rids, lids = _ids(remote, n, 1), _ids(local, n, 2)
    lpool, rpool = _pool(local), _pool(remote)
    before = [x.copy() for x in lpool]
    write_token_pattern(remote, rpool, rids, n, seed=3)
    assert verify_token_pattern(remote, rpool, rids, n, seed=3) is None
    assert verify_token_pattern(local, lpool, lids, n, seed=3) is not None
    _apply(plan_pull(read_geometry(local, remote), lids, rids, -1, n), lpool, rpool)
    assert verify_token_pattern(local, lpool, lids, n, seed=3) is None
    mask = token_footprint(local, lids, n)
    assert sum(int(m.sum()) for m in mask) == 2 * 2 * 2 * n * 4 * 2  # layers, K/V, heads, tokens
    for b, x, m in zip(before, lpool, mask, strict=True):
        assert not ((b != x) & ~m).any()


@pytest.mark.parametrize("name", ["granite-4.0-h-tiny", "qwen3-next-80b-a3b"])
def test_the_state_of_an_sd_conv_layout_is_covered_row_by_row(name):
    """In vLLM's SD conv layout a section's unit is one run per conv row: the token pattern
    writes and checks every row of it, and its footprint is exactly the state block's parts."""
    m = _plan(name, conv_layout="SD", tp_size=2)
    assert any(p.rows > 1 for g in m.groups if g.kind == "mamba" for la in g.layers
               for p in la.conv)  # fmt: skip
    regions, ids, tokens = _pool(m), _ids(m, 40, 1), 40
    write_token_pattern(m, regions, ids, tokens, seed=9)
    assert verify_token_pattern(m, regions, ids, tokens, seed=9) is None
    g = next(i for i, gr in enumerate(m.groups) if gr.kind == "mamba")
    layer = m.groups[g].layers[0]
    part = next(p for p in layer.conv if p.rows > 1)
    last_row = part.offset + ids[g][-1] * part.block_stride + (part.rows - 1) * part.row_stride
    regions[layer.region][last_row] ^= 0xFF  # the last conv row's first byte
    bad = verify_token_pattern(m, regions, ids, tokens, seed=9)
    assert bad is not None and bad.part == part.name and bad.group == g
    masks = token_footprint(m, ids, tokens)
    assert masks[layer.region][last_row]


def _request_bytes(m: Manifest, ids: list[list[int]], tokens: int) -> list[np.ndarray]:
    """Per region, where the placement puts the request: its tokens' K and V rows of every local
    head (the store's canonical views; a sliding group's window only) and each state block."""
    marks = [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]
    for g, group in enumerate(m.groups):
        if group.kind != "mamba":
            start = max(0, tokens - group.sliding_window) if group.sliding_window else 0
            fill_tokens(m, marks, g, np.asarray(ids[g]), start, tokens, 1)
            continue
        for layer in group.layers:
            for p in [*layer.conv, layer.ssm]:
                at = (p.offset + ids[g][-1] * p.block_stride
                      + np.arange(p.units)[:, None, None] * p.unit_stride
                      + np.arange(p.rows)[None, :, None] * p.row_stride
                      + np.arange(p.unit_bytes))  # fmt: skip
                marks[layer.region][at.ravel()] = 1
    return [x.astype(bool) for x in marks]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("packing", ["token", "block"])
@pytest.mark.parametrize("head_layout", ["HND", "NHD"])
@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt-oss-20b", "granite-4.0-h-tiny"])
def test_every_planned_layout_verifies_its_own_write_over_exactly_the_requests_bytes(
    name, head_layout, packing, tp
):
    """Whatever the head layout and K/V packing: what was written verifies, the footprint is
    where the placement puts the request's K/V rows and state (nothing else is written), and a
    flipped byte anywhere in it is named by its address."""
    m = _plan(name, head_layout=head_layout, kv_packing=packing, tp_size=tp, tp_rank=tp - 1)
    tokens = max([g.block_size + 5 for g in m.groups]
                 + [g.sliding_window + 9 for g in m.groups if g.sliding_window])  # fmt: skip
    ids = _ids(m, tokens, 1)
    pool = _pool(m)
    write_token_pattern(m, pool, ids, tokens, seed=11)
    assert verify_token_pattern(m, pool, ids, tokens, seed=11) is None
    footprint = token_footprint(m, ids, tokens)
    for mask, want, region in zip(footprint, _request_bytes(m, ids, tokens), pool, strict=True):
        assert np.array_equal(mask, want)
        assert (region[~mask] == 0xA5).all()
    rng = np.random.default_rng(0)
    used = [r for r, mask in enumerate(footprint) if mask.any()]
    for r in {used[0], used[-1]}:
        inside = np.flatnonzero(footprint[r])
        for at in [int(inside[0]), int(inside[-1]), *rng.choice(inside, 2).tolist()]:
            pool[r][at] ^= 0xFF
            bad = verify_token_pattern(m, pool, ids, tokens, seed=11)
            assert bad is not None and (bad.region, bad.address) == (r, at)
            pool[r][at] ^= 0xFF


def test_packed_kv_gives_a_heads_token_the_same_bytes_in_nhd_and_hnd():
    """vLLM's packed K|V holds each head's token as its own row in either head layout, so the
    pattern names it by (token, global head) alike: the canonical (store) bytes are equal."""
    tokens, ids = 21, [[3, 1]]
    sides = []
    for head_layout in ("HND", "NHD"):
        m = _plan("llama-3.1-8b", head_layout=head_layout, tp_size=2, tp_rank=1)
        pool = _pool(m)
        write_token_pattern(m, pool, ids, tokens, seed=4)
        group = m.groups[0]
        tm = token_map(group, np.asarray(ids[0]), 0, tokens, "block_ids[0]")
        canonical = []
        for spec in part_specs(m, 0):
            out = np.empty(part_bytes(spec, group, tokens), dtype=np.uint8)
            canonical.append(gather_attention(pool[spec.region], spec, group, m.num_blocks, tm,
                                              out).copy())  # fmt: skip
        sides.append(canonical)
    assert len(sides[0]) == len(sides[1]) == 2 * 32
    for hnd, nhd in zip(*sides, strict=True):
        assert np.array_equal(hnd, nhd)


def _reversed_ids(m: Manifest, tokens: int) -> list[list[int]]:
    out, nxt = [], 1
    for g in m.groups:
        k = 1 if g.kind == "mamba" else -(-tokens // g.block_size)
        out.append(list(range(nxt + k - 1, nxt - 1, -1)))
        nxt += k
    return out


# (model, plan options, tokens): blake2b-64 of every region after the write, token digest. The
# bytes are a wire contract between a prefill and a decode of different releases.
PINNED = [
    ("llama-3.1-8b", {"tp_size": 8, "tp_rank": 3}, 21, "bdf84eefae13b915", 0xCF4B38C36333C768),
    ("llama-3.1-8b", {"head_layout": "NHD", "kv_packing": "block", "tp_size": 4, "tp_rank": 2},
     37, "9d441fb91efb6bdd", 0x98EF90C22F7CA9A6),
    ("qwen3-8b", {"kv_packing": "block", "cross_layer": True, "tp_size": 4}, 19,
     "3ccfb5574032f658", 0xBED3321E63C349C9),
    ("gpt-oss-20b", {"tp_size": 8, "tp_rank": 5}, 150, "ac4e52005e2e2d03", 0x1661B414DB06DCF2),
    ("granite-4.0-h-tiny", {"tp_size": 2, "tp_rank": 1, "conv_layout": "SD"}, 40,
     "77d481d685e74803", 0x4655E90CA811E7B7),
    ("qwen3-next-80b-a3b", {"attn_pack_size": 4, "tp_size": 8}, 70, "fa0a23f175a3b164",
     0x11FF9762E7AAD317),
]  # fmt: skip


@pytest.mark.parametrize(("name", "opts", "tokens", "pool_hash", "digest"), PINNED)
def test_the_token_pattern_writes_the_bytes_earlier_releases_wrote(
    name, opts, tokens, pool_hash, digest
):
    m = plan_manifest(load_hf_config(name), PlanOptions(num_blocks=40, **opts))
    pool = [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]
    ids = _reversed_ids(m, tokens)
    write_token_pattern(m, pool, ids, tokens, seed=1234567)
    h = hashlib.blake2b(digest_size=8)
    for region in pool:
        h.update(region.tobytes())
    assert h.hexdigest() == pool_hash
    assert token_digest(m, pool, ids, tokens) == digest
    assert verify_token_pattern(m, pool, ids, tokens, seed=1234567) is None


@pytest.mark.parametrize("batch_bytes", [1, 3000, 1 << 30])
def test_parts_generated_together_or_apart_give_the_same_bytes_and_name_the_wrong_part(
    monkeypatch, batch_bytes
):
    """Parts of one row shape are generated in one pass up to a byte bound: wherever the bound
    cuts, the bytes are the same and a wrong byte is named by its own part and layer."""
    m = _plan("qwen3-8b", tp_size=4, kv_packing="block")
    ids, tokens = _reversed_ids(m, 21), 21
    alone = _pool(m)
    monkeypatch.setattr(pattern, "_BATCH_BYTES", 1)
    write_token_pattern(m, alone, ids, tokens, seed=5)
    monkeypatch.setattr(pattern, "_BATCH_BYTES", batch_bytes)
    pool = _pool(m)
    write_token_pattern(m, pool, ids, tokens, seed=5)
    for a, b in zip(alone, pool, strict=True):
        assert np.array_equal(a, b)
    layers = m.groups[0].layers
    for layer, part in ((layers[1], layers[1].v), (layers[-2], layers[-2].k)):
        at = part.offset + ids[0][0] * part.block_stride + 3  # first block, a byte of token 0
        pool[layer.region][at] ^= 0xFF
        bad = verify_token_pattern(m, pool, ids, tokens, seed=5)
        assert bad is not None and (bad.layer, bad.part, bad.address) == (layer.name, part.name, at)
        pool[layer.region][at] ^= 0xFF
