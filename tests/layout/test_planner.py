"""The planner reproduces vLLM's layout: block sizes, pages, groups, pools and byte placement."""

from __future__ import annotations

import pytest

from kvxferd.errors import ManifestError, UnsupportedModelError
from kvxferd.layout import (
    PlanOptions,
    block_ratio,
    load_hf_config,
    mamba_padding_bytes,
    page_bytes,
    plan_manifest,
    preset_names,
    validate_manifest,
)
from kvxferd.wire import (
    MODEL_MAX_LENGTH,
    AttentionLayer,
    MambaLayer,
    Manifest,
    decode_manifest,
    encode_manifest,
)


def plan(name: str, **options) -> Manifest:
    return plan_manifest(load_hf_config(name), PlanOptions(**options))


def kinds(m: Manifest) -> list[str]:
    return [g.kind for g in m.groups]


class TestQwen35At397B:
    """Seed 000: Qwen3.5-397B-A17B at TP2, fp32 SSM state (the model's hook)."""

    def test_block_size_2096_and_page(self):
        m = plan("qwen3.5-397b-a17b", tp_size=2)
        assert {g.block_size for g in m.groups} == {2096}
        assert page_bytes(m) == 2146304  # 2096 tokens * 1024 B (1 KV head of 256, bf16, K+V)
        # conv (3, 6144) bf16 + ssm (32, 128, 128) fp32 = 36864 + 2097152
        assert mamba_padding_bytes(m) == 2146304 - (36864 + 2097152)

    def test_attn_pack_size_shrinks_the_block(self):
        assert plan("qwen3.5-397b-a17b", tp_size=2, attn_pack_size=2).groups[0].block_size == 1056
        assert plan("qwen3.5-397b-a17b", tp_size=2, attn_pack_size=4).groups[0].block_size == 528

    def test_groups_and_pooled_regions(self):
        m = plan("qwen3.5-397b-a17b", tp_size=2)
        assert kinds(m) == ["mamba"] * 3 + ["full_attention"]
        assert [len(g.layers) for g in m.groups] == [15, 15, 15, 15]
        assert len(m.regions) == 15
        # Strided assignment: GDN group 1 takes the 2nd, 5th, 8th... GDN layer.
        assert [x.index for x in m.groups[1].layers[:3]] == [1, 5, 9]

    def test_fp32_state_splits_blocks_into_16_token_kernel_blocks(self):
        attn = plan("qwen3.5-397b-a17b", tp_size=2).groups[-1]
        assert attn.kernel_block_size == 16 and block_ratio(attn) == 131

    def test_bf16_state_keeps_the_whole_block_as_kernel_block(self):
        m = plan("qwen3.5-397b-a17b", tp_size=2, mamba_ssm_cache_dtype="bfloat16")
        assert m.groups[-1].kernel_block_size == m.groups[-1].block_size

    def test_packed_layers_share_a_page_side_by_side(self):
        m = plan("qwen3.5-397b-a17b", tp_size=2, attn_pack_size=2)
        attn = m.groups[-1]
        first, second = attn.layers[0], attn.layers[1]
        assert isinstance(first, AttentionLayer) and isinstance(second, AttentionLayer)
        assert (first.index, second.index) == (3, 7) and first.region == second.region
        assert (first.pack_index, second.pack_index) == (0, 1)
        row = 256 * 2  # one token of one 256-element bf16 head
        kpage = 32 * 2 * row  # 32-token kernel block, 1 head, [K | V] per token
        assert (first.k.offset, first.v.offset, second.k.offset) == (0, row, kpage)
        assert first.k.block_stride == 2 * kpage  # [pack0 page][pack1 page] per kernel block
        assert (first.k.rows, first.k.row_stride) == (32, 2 * row)
        assert len(m.regions) == 8  # 15 layers -> 8 packs
        assert kinds(m).count("mamba") == 6  # cdiv(45, 8)


class TestGraniteTiny:
    """granite-4.0-h-tiny at TP1, bf16 everywhere (seed 004's shapes)."""

    def test_block_page_and_padding(self):
        m = plan("granite-4.0-h-tiny")
        assert m.groups[0].block_size == 400
        assert page_bytes(m) == 819200
        assert mamba_padding_bytes(m) == 819200 - (19968 + 786432)
        assert round(100 * mamba_padding_bytes(m) / (19968 + 786432), 2) == 1.59

    @pytest.mark.parametrize(("layout", "shape"), [("SD", [3, 3328]), ("DS", [3328, 3])])
    def test_conv_and_ssm_shapes(self, layout, shape):
        layer = plan("granite-4.0-h-tiny", conv_layout=layout).groups[0].layers[0]
        assert isinstance(layer, MambaLayer)
        assert layer.conv_shape == shape and layer.ssm_shape == [48, 64, 128]

    def test_group_size_4_gives_9_mamba_groups_and_1_attention_group(self):
        m = plan("granite-4.0-h-tiny")
        assert kinds(m) == ["mamba"] * 9 + ["full_attention"]
        assert len(m.regions) == 4
        assert [x.index for x in m.groups[-1].layers] == [5, 15, 25, 35]
        # Region i is shared by the i-th layer of every group.
        assert {g.layers[2].region for g in m.groups} == {2}

    def test_mamba_page_is_conv_then_ssm_with_ds_sections(self):
        layer = plan("granite-4.0-h-tiny").groups[0].layers[0]
        assert isinstance(layer, MambaLayer)
        assert [(p.name, p.offset, p.units, p.unit_bytes) for p in layer.conv] == [
            ("conv_x", 0, 48, 64 * 3 * 2),
            ("conv_b", 18432, 1, 128 * 3 * 2),
            ("conv_c", 19200, 1, 128 * 3 * 2),
        ]
        assert (layer.ssm.offset, layer.ssm.units, layer.ssm.unit_bytes) == (19968, 48, 16384)
        assert layer.ssm.block_stride == 819200

    def test_sd_conv_sections_are_one_run_per_row(self):
        layer = plan("granite-4.0-h-tiny", conv_layout="SD", tp_size=2).groups[0].layers[0]
        assert isinstance(layer, MambaLayer)
        row = (24 * 64 + 2 * 128) * 2  # x + B + C channels of this rank (1 group, replicated), bf16
        assert [
            (p.name, p.offset, p.units, p.unit_bytes, p.units_total, p.rows, p.row_stride)
            for p in layer.conv
        ] == [
            ("conv_x", 0, 24, 64 * 2, 48, 3, row),
            ("conv_b", 24 * 64 * 2, 1, 128 * 2, 1, 3, row),
            ("conv_c", (24 * 64 + 128) * 2, 1, 128 * 2, 1, 3, row),
        ]
        assert all(p.sliceable for p in layer.conv)
        assert layer.ssm.offset == 3 * row  # the SSM state follows the conv state's last row

    def test_hybrid_attention_packs_k_and_v_per_token_hnd(self):
        layer = plan("granite-4.0-h-tiny").groups[-1].layers[0]
        assert isinstance(layer, AttentionLayer) and layer.kv_order == "blocks_first"
        row = 128 * 2  # one token of one bf16 head
        head = 400 * 2 * row  # one head's [K | V] rows of a 400-token block
        assert (layer.k.offset, layer.v.offset, layer.k.block_stride) == (0, row, 4 * head)
        assert (layer.k.units, layer.k.unit_bytes, layer.k.unit_stride) == (4, row, head)
        assert (layer.k.rows, layer.k.row_stride, layer.k.units_total) == (400, 2 * row, 4)

    def test_block_packing_keeps_k_then_v_per_kernel_block(self):
        layer = plan("granite-4.0-h-tiny", kv_packing="block").groups[-1].layers[0]
        assert isinstance(layer, AttentionLayer) and layer.kv_order == "blocks_first"
        piece = 400 * 4 * 128 * 2  # one kernel block of K, all 4 heads
        assert (layer.k.offset, layer.v.offset, layer.k.block_stride) == (0, piece, 2 * piece)
        assert (layer.k.units, layer.k.unit_bytes, layer.k.units_total) == (4, piece // 4, 4)


class TestPureAttention:
    def test_dense_llama_is_one_group_with_a_region_per_layer_packed_per_token(self):
        m = plan("llama-3.1-8b", num_blocks=10)
        assert kinds(m) == ["full_attention"] and len(m.regions) == 32
        layer = m.groups[0].layers[7]
        assert isinstance(layer, AttentionLayer) and layer.region == 7
        row = 128 * 2  # one token of one bf16 head
        page = 8 * 16 * 2 * row  # 8 heads x 16 tokens x [K | V]
        assert layer.kv_order == "blocks_first"  # vLLM 0.33: dense pages too
        assert (layer.k.offset, layer.v.offset, layer.k.block_stride) == (0, row, page)
        assert m.regions[7].size_bytes == 10 * page

    def test_block_packing_dense_is_kv_first(self):
        m = plan("llama-3.1-8b", num_blocks=10, kv_packing="block")
        layer = m.groups[0].layers[7]
        hs = 16 * 8 * 128 * 2  # K of one 16-token block, 8 heads, bf16
        assert layer.kv_order == "kv_first"
        assert (layer.k.offset, layer.k.block_stride) == (0, hs)
        assert (layer.v.offset, layer.v.block_stride) == (10 * hs, hs)  # after all K blocks
        assert m.regions[7].size_bytes == 2 * 10 * hs

    def test_block_packing_blocks_first_on_request(self):
        opts = {"kv_order": "blocks_first", "kv_packing": "block"}
        layer = plan("qwen3-8b", **opts).groups[0].layers[0]
        hs = 16 * 8 * 128 * 2
        assert (layer.k.offset, layer.v.offset, layer.k.block_stride) == (0, hs, 2 * hs)

    def test_kv_first_needs_block_packing(self):
        with pytest.raises(ManifestError) as err:
            plan("qwen3-8b", kv_order="kv_first")
        assert err.value.field == "options.kv_order"

    def test_nhd_heads_are_sliceable_token_rows(self):
        layer = plan("llama-3.1-8b", head_layout="NHD", tp_size=2).groups[0].layers[0]
        row = 128 * 2
        assert (layer.k.units, layer.k.unit_bytes, layer.k.unit_stride) == (4, row, 2 * row)
        assert (layer.k.rows, layer.k.row_stride, layer.k.sliceable) == (16, 4 * 2 * row, True)

    def test_block_packing_nhd_is_one_unsliceable_unit(self):
        opts = {"head_layout": "NHD", "tp_size": 2, "kv_packing": "block"}
        layer = plan("llama-3.1-8b", **opts).groups[0].layers[0]
        assert (layer.k.units, layer.k.unit_bytes, layer.k.sliceable) == (
            1,
            16 * 4 * 128 * 2,
            False,
        )

    def test_user_block_size(self):
        assert plan("llama-3.1-8b", block_size=64).groups[0].block_size == 64
        with pytest.raises(ManifestError) as err:
            plan("llama-3.1-8b", block_size=24)
        assert err.value.field == "options.block_size"

    def test_sliding_window_gives_two_pooled_groups(self):
        m = plan("gpt-oss-20b")
        assert kinds(m) == ["sliding_window", "full_attention"]
        assert m.groups[0].sliding_window == 128 and m.groups[1].sliding_window is None
        assert len(m.regions) == 12
        assert [g.layers[3].region for g in m.groups] == [3, 3]

    def test_kv_heads_replicate_when_tp_exceeds_them(self):
        layer = plan("qwen3.5-397b-a17b", tp_size=4).groups[-1].layers[0]
        assert (layer.num_kv_heads, layer.total_kv_heads, layer.k.units_total) == (1, 2, 2)


class TestCrossLayer:
    """Seed 001: one region per page size, laid out (num_blocks, layers, page)."""

    def test_layer_slot_inside_each_block(self):
        m = plan("gpt-oss-20b", cross_layer=True, num_blocks=8)
        assert m.layout == "cross_layer" and len(m.regions) == 1
        page = 2 * 16 * 8 * 64 * 2
        assert m.regions[0].page_bytes == 12 * page and page_bytes(m) == page
        layer = m.groups[1].layers[5]
        assert (layer.k.offset, layer.v.offset) == (5 * page, 5 * page + 64 * 2)
        assert layer.k.block_stride == 12 * page

    def test_hnd_tp2_puts_heads_before_layers(self):
        m = plan("qwen3-8b", cross_layer=True, tp_size=2)
        ph = 2 * 16 * 128 * 2  # one head's K and V for one block
        layer = m.groups[0].layers[3]
        assert (layer.k.offset, layer.k.unit_stride, layer.k.unit_bytes) == (
            3 * ph,
            36 * ph,
            128 * 2,
        )
        assert layer.k.block_stride == 4 * 36 * ph

    def test_hybrid_hnd_tp2_puts_heads_before_layers_and_pages_after_slots(self):
        m = plan("granite-4.0-h-tiny", cross_layer=True, tp_size=2)  # vLLM's BHLNC
        page = m.regions[0].page_bytes // 4  # 4 layer slots per block
        mamba, attn = m.groups[0].layers[3], m.groups[-1].layers[3]
        assert isinstance(attn, AttentionLayer) and mamba.region == attn.region == 0
        assert mamba.conv[0].offset == 3 * page  # a Mamba page has one "head"
        assert (attn.k.offset, attn.k.unit_stride) == (3 * page // 2, 4 * page // 2)

    def test_hybrid_with_split_kernel_blocks_is_rejected(self):
        with pytest.raises(UnsupportedModelError) as err:
            plan("qwen3.5-397b-a17b", cross_layer=True)
        assert err.value.field == "options.cross_layer"

    def test_hybrid_with_whole_kernel_blocks_is_supported(self):
        m = plan("granite-4.0-h-tiny", cross_layer=True)
        assert len(m.regions) == 1 and m.regions[0].page_bytes == 4 * 819200


class TestOptions:
    def test_fp8_kv_halves_the_attention_token(self):
        m = plan("granite-4.0-h-tiny", kv_cache_dtype="fp8")
        assert m.groups[-1].layers[0].dtype == "float8_e4m3fn"
        assert m.groups[0].block_size == 16 * -(-806400 // (16 * 1024))  # 800

    def test_alignment_is_max_of_backend_and_user_block_size(self):
        assert plan("granite-4.0-h-tiny", block_size=64).groups[0].block_size == 448

    def test_speculative_tokens_grow_conv_rows(self):
        layer = plan("granite-4.0-h-tiny", num_speculative_tokens=2).groups[0].layers[0]
        assert layer.conv_shape == [3328, 5]

    def test_nemotron_fp32_ssm_fallback(self):
        m = plan("nemotron-h-8b")
        assert m.groups[0].layers[0].ssm_dtype == "float32"
        assert m.groups[-1].kernel_block_size == 16

    def test_mamba_cache_mode_all_rounds_to_the_chunk(self):
        assert plan("granite-4.0-h-tiny", mamba_cache_mode="all").groups[0].block_size == 512

    def test_kv_first_is_refused_for_hybrids(self):
        with pytest.raises(ManifestError) as err:
            plan("granite-4.0-h-tiny", kv_order="kv_first")
        assert err.value.field == "options.kv_order"

    def test_pack_size_is_refused_for_pure_attention(self):
        with pytest.raises(ManifestError) as err:
            plan("llama-3.1-8b", attn_pack_size=2)
        assert err.value.field == "options.attn_pack_size"

    def test_bad_rank_and_bad_tp(self):
        with pytest.raises(ManifestError) as err:
            plan("llama-3.1-8b", tp_size=2, tp_rank=2)
        assert err.value.field == "options.tp_rank"
        with pytest.raises(ManifestError) as err:
            plan("llama-3.1-8b", tp_size=3)
        assert err.value.field == "options.tp_size"

    @pytest.mark.parametrize(
        ("option", "value"),
        [("head_layout", "HDN"), ("conv_layout", "X"), ("mamba_cache_mode", "full")],
    )
    def test_unknown_choices_are_named(self, option, value):
        with pytest.raises(ManifestError) as err:
            plan("granite-4.0-h-tiny", **{option: value})
        assert err.value.field == f"options.{option}"

    def test_region_names_carry_engine_and_rank(self):
        m = plan("llama-3.1-8b", tp_size=2, tp_rank=1, engine_id="P0")
        assert m.regions[0].name == "kvxferd-p0-r1-0" and m.engine_id == "P0"
        assert plan("granite-4.0-h-tiny").regions[3].name == "kvxferd-granite-4.0-h-tiny-r0-3"


VARIANTS = [
    {},
    {"tp_size": 2, "tp_rank": 1},
    {"head_layout": "NHD"},
    {"conv_layout": "SD"},
    {"attn_pack_size": 2},
    {"attn_pack_size": 4, "tp_size": 2},
    {"cross_layer": True},
    {"cross_layer": True, "tp_size": 2},
    {"kv_order": "blocks_first"},
    {"kv_packing": "block"},
    {"kv_packing": "block", "head_layout": "NHD", "tp_size": 2},
    {"kv_packing": "block", "cross_layer": True, "tp_size": 2},
]


@pytest.mark.parametrize("name", preset_names())
@pytest.mark.parametrize(
    "variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items())
)
def test_every_planned_manifest_validates_and_round_trips(name, variant):
    try:
        m = plan(name, num_blocks=5, **variant)
    except (UnsupportedModelError, ManifestError) as exc:  # documented refusals only
        assert exc.field in ("options.cross_layer", "options.attn_pack_size", "options.kv_order")
        return
    validate_manifest(m)
    assert decode_manifest(encode_manifest(m)) == m


def test_a_model_path_past_the_manifests_bound_is_cut_and_still_round_trips():
    """``_name_or_path`` may be a long local path; the manifest's model is informational and
    bounded on the wire, so the planner keeps its first MODEL_MAX_LENGTH characters."""
    config = {**load_hf_config("llama-3.1-8b"), "_name_or_path": "/models/" + "x" * 2000}
    m = plan_manifest(config, PlanOptions(num_blocks=4))
    assert m.model == config["_name_or_path"][:MODEL_MAX_LENGTH]
    assert decode_manifest(encode_manifest(m)) == m
