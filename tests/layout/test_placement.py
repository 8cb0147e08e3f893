"""Byte placement against independent reference views of vLLM's tensors.

Each reference reshapes a region's byte indices the way vLLM 0.33 views the memory (one kernel
block of a layer is ``[H, kbs, K|V]`` or ``[kbs, H, K|V]``; cross-layer pools put layers, or
heads then layers, inside a block) and checks that every TP unit of every block unit of a
planned Part names exactly those bytes. The older block-packed pages (``kv_packing="block"``,
research notes §4 and seeds 000/001) keep their own references.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.layout import PlanOptions, block_ratio, load_hf_config, plan_manifest
from kvxferd.wire import AttentionLayer, MambaLayer, Manifest, Part

NUM_BLOCKS = 3


def plan(name: str, **options) -> Manifest:
    return plan_manifest(load_hf_config(name), PlanOptions(num_blocks=NUM_BLOCKS, **options))


def unit_range(part: Part, u: int, i: int) -> np.ndarray:
    """Every byte of TP unit ``i`` in block unit ``u``, rows in order."""
    start = part.offset + u * part.block_stride + i * part.unit_stride
    rows = start + np.arange(part.rows)[:, None] * part.row_stride
    return (rows + np.arange(part.unit_bytes)[None, :]).ravel()


def region_bytes(m: Manifest, r: int) -> np.ndarray:
    return np.arange(m.regions[r].size_bytes, dtype=np.int64)


def assert_kv(layer: AttentionLayer, view_of, ratio: int) -> None:
    """``view_of(kv, kernel_block, head)`` gives the reference bytes of one head's K or V."""
    for kb in range(NUM_BLOCKS * ratio):
        for kv, part in enumerate((layer.k, layer.v)):
            for h in range(layer.num_kv_heads):
                want = view_of(kv, kb, h).ravel()
                if part.units == layer.num_kv_heads:  # a head per TP unit
                    np.testing.assert_array_equal(unit_range(part, kb, h), want)
                else:  # block-packed NHD: all heads are one unit
                    assert np.isin(want, unit_range(part, kb, 0)).all()


def test_pure_attention_lbhnc_packs_k_and_v_per_token():
    m = plan("llama-3.1-8b", tp_size=4)
    layer = m.groups[0].layers[2]
    # (Nk, H, kbs, [K | V]) with 2 local heads, 16-token kernel blocks, 128-element bf16 heads.
    ref = region_bytes(m, layer.region).reshape(NUM_BLOCKS, 2, 16, 2, 128 * 2)
    assert_kv(layer, lambda kv, kb, hh: ref[kb, hh, :, kv], 1)


def test_pure_attention_lbnhc_heads_side_by_side_per_token():
    m = plan("qwen3-8b", head_layout="NHD", tp_size=2)
    layer = m.groups[0].layers[0]
    ref = region_bytes(m, layer.region).reshape(NUM_BLOCKS, 16, 4, 2, 256)  # (Nk, kbs, H, 2, D)
    assert_kv(layer, lambda kv, kb, hh: ref[kb, :, hh, kv], 1)
    assert layer.k.sliceable  # a head is its own rows, so a peer may read some heads


@pytest.mark.parametrize("pack", [1, 2, 4])
def test_hybrid_packed_pages_with_attention_packs(pack):
    m = plan("qwen3.5-397b-a17b", tp_size=2, attn_pack_size=pack)
    attn = m.groups[-1]
    ratio, kbs = block_ratio(attn), attn.kernel_block_size
    for layer in attn.layers[: 2 * pack]:
        # Page = ratio kernel blocks; each holds the pack's layers' [H, kbs, K|V] side by side.
        ref = region_bytes(m, layer.region).reshape(NUM_BLOCKS * ratio, pack, 1, kbs, 2, 256 * 2)
        assert_kv(layer, lambda kv, kb, hh, p=layer.pack_index, r=ref: r[kb, p, hh, :, kv], ratio)


def test_cross_layer_blnhc_layers_then_tokens():
    m = plan("gpt-oss-20b", cross_layer=True, head_layout="NHD")
    ref = region_bytes(m, 0).reshape(NUM_BLOCKS, 12, 16, 8, 2, 64 * 2)  # (B, L, kbs, H, 2, D)
    for slot, layer in enumerate(m.groups[1].layers):
        assert_kv(layer, lambda kv, kb, hh, s=slot: ref[kb, s, :, hh, kv], 1)


def test_cross_layer_bhlnc_heads_before_layers_under_tp():
    m = plan("qwen3-8b", cross_layer=True, tp_size=2)
    ref = region_bytes(m, 0).reshape(NUM_BLOCKS, 4, 36, 16, 2, 128 * 2)  # (B, H, L, kbs, 2, D)
    for slot, layer in enumerate(m.groups[0].layers):
        assert_kv(layer, lambda kv, kb, hh, s=slot: ref[kb, hh, s, :, kv], 1)


def test_block_packing_kv_first_hnd_matches_fa_shape():
    m = plan("llama-3.1-8b", tp_size=4, kv_packing="block")
    layer = m.groups[0].layers[2]
    nk, h, kbs, d_bytes = NUM_BLOCKS, 2, 16, 128 * 2
    # FA (2, Nk, kbs, H, D) with HND stride order: physically (2, Nk, H, kbs, D).
    ref = region_bytes(m, layer.region).reshape(2, nk, h, kbs, d_bytes)
    assert_kv(layer, lambda kv, kb, hh: ref[kv, kb, hh], 1)


def test_block_packing_nhd_unit_covers_all_heads_of_a_block():
    m = plan("qwen3-8b", head_layout="NHD", tp_size=2, kv_packing="block")
    layer = m.groups[0].layers[0]
    ref = region_bytes(m, layer.region).reshape(2, NUM_BLOCKS, 16, 4, 256)  # (2, Nk, kbs, H, D)
    assert_kv(layer, lambda kv, kb, hh: ref[kv, kb, :, hh], 1)


@pytest.mark.parametrize("pack", [1, 2, 4])
def test_block_packing_hybrid_blocks_first_with_packs_matches_strided_fa_view(pack):
    m = plan("qwen3.5-397b-a17b", tp_size=2, attn_pack_size=pack, kv_packing="block")
    attn = m.groups[-1]
    ratio, kbs = block_ratio(attn), attn.kernel_block_size
    for layer in attn.layers[: 2 * pack]:
        # Page = ratio kernel blocks; each holds [pack0 K|V][pack1 K|V]..., HND inside.
        ref = region_bytes(m, layer.region).reshape(NUM_BLOCKS * ratio, pack, 2, 1, kbs, 256 * 2)
        assert_kv(layer, lambda kv, kb, hh, p=layer.pack_index, r=ref: r[kb, p, kv, hh], ratio)


def test_block_packing_cross_layer_nhd_slots_then_kv():
    m = plan("gpt-oss-20b", cross_layer=True, head_layout="NHD", kv_packing="block")
    ref = region_bytes(m, 0).reshape(NUM_BLOCKS, 12, 2, 16, 8, 64 * 2)  # (blocks, L, 2, kbs, H, D)
    for slot, layer in enumerate(m.groups[1].layers):
        assert_kv(layer, lambda kv, kb, hh, s=slot: ref[kb, s, kv, :, hh], 1)


def test_block_packing_cross_layer_hnd_tp2_heads_before_layers():
    m = plan("qwen3-8b", cross_layer=True, tp_size=2, kv_packing="block")
    ref = region_bytes(m, 0).reshape(NUM_BLOCKS, 4, 36, 2, 16, 128 * 2)  # (blocks, H, L, 2, ...)
    for slot, layer in enumerate(m.groups[0].layers):
        assert_kv(layer, lambda kv, kb, hh, s=slot: ref[kb, hh, s, kv], 1)


@pytest.mark.parametrize(("name", "tp"), [("granite-4.0-h-tiny", 2), ("qwen3.5-397b-a17b", 2)])
def test_mamba_ds_sections_and_ssm_match_page_views(name, tp):
    m = plan(name, tp_size=tp)
    layer = m.groups[0].layers[1]
    assert isinstance(layer, MambaLayer)
    page = m.regions[layer.region].page_bytes
    dim, rows = layer.conv_shape
    conv_dt = 2  # bf16 conv state in both models
    conv_bytes = dim * rows * conv_dt
    pages = region_bytes(m, layer.region).reshape(NUM_BLOCKS, page)
    for b in range(NUM_BLOCKS):
        conv = pages[b, :conv_bytes].reshape(dim, rows * conv_dt)  # DS: (dim, state_len)
        channel = 0
        for part in layer.conv:
            per_unit = part.unit_bytes // (rows * conv_dt)
            for i in range(part.units):
                want = conv[channel : channel + per_unit].ravel()
                np.testing.assert_array_equal(unit_range(part, b, i), want)
                channel += per_unit
        assert channel == dim
        ssm = pages[b, conv_bytes : conv_bytes + layer.ssm.units * layer.ssm.unit_bytes]
        ssm = ssm.reshape(layer.ssm_shape[0], -1)
        for i in range(layer.ssm.units):
            np.testing.assert_array_equal(unit_range(layer.ssm, b, i), ssm[i])


@pytest.mark.parametrize("packing", ["token", "block"])
def test_hybrid_attention_group_tiles_every_page_exactly_once(packing):
    m = plan("granite-4.0-h-tiny", tp_size=2, kv_packing=packing)
    hits = np.zeros(m.regions[0].size_bytes, dtype=np.int64)
    for layer in (x for x in m.groups[-1].layers if x.region == 0):
        for part in (layer.k, layer.v):
            for u in range(NUM_BLOCKS * block_ratio(m.groups[-1])):
                for i in range(part.units):
                    hits[unit_range(part, u, i)] += 1
    assert (hits == 1).all()
