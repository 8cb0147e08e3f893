"""validate_manifest: planned manifests pass; each broken invariant is named by its field."""

from __future__ import annotations

import msgspec
import pytest

from kvxferd.errors import ManifestError
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest, validate_manifest
from kvxferd.wire import Manifest

replace = msgspec.structs.replace


def plan(name: str, **options) -> Manifest:
    return plan_manifest(load_hf_config(name), PlanOptions(num_blocks=4, **options))


def with_layer(m: Manifest, g: int, i: int, **changes) -> Manifest:
    group = m.groups[g]
    layers = list(group.layers)
    layers[i] = replace(layers[i], **changes)
    groups = list(m.groups)
    groups[g] = replace(group, layers=layers)
    return replace(m, groups=groups)


def with_group(m: Manifest, g: int, **changes) -> Manifest:
    groups = list(m.groups)
    groups[g] = replace(groups[g], **changes)
    return replace(m, groups=groups)


def field_of(m: Manifest) -> str:
    with pytest.raises(ManifestError) as err:
        validate_manifest(m)
    return err.value.field


GRANITE = plan("granite-4.0-h-tiny")
ATTN = len(GRANITE.groups) - 1  # granite's attention group is last


def test_two_layers_of_one_group_in_one_region_overlap():
    # A packed [K|V] layer is checked as its merged runs, so the layer is named.
    assert field_of(with_layer(GRANITE, ATTN, 1, region=0)) == f"groups[{ATTN}].layers[1]"


def test_two_block_packed_layers_in_one_region_overlap_at_k():
    m = plan("granite-4.0-h-tiny", kv_packing="block")
    assert field_of(with_layer(m, ATTN, 1, region=0)) == f"groups[{ATTN}].layers[1].k"


def test_ssm_moved_into_conv_overlaps():
    layer = GRANITE.groups[0].layers[0]
    bad = with_layer(GRANITE, 0, 0, ssm=replace(layer.ssm, offset=layer.ssm.offset - 2))
    assert field_of(bad) == "groups[0].layers[0].ssm"


@pytest.mark.parametrize(("packing", "field"), [("token", ""), ("block", ".v")])
def test_part_past_region_end_on_the_last_block_only(packing, field):
    m = plan("llama-3.1-8b", kv_packing=packing)
    layer = m.groups[0].layers[0]
    shifted = replace(layer.v, offset=layer.v.offset + layer.v.block_stride)  # last V block spills
    assert field_of(with_layer(m, 0, 0, v=shifted)) == f"groups[0].layers[0]{field}"


def test_mamba_page_overflowing_into_next_block_is_past_end():
    layer = GRANITE.groups[0].layers[0]
    page = GRANITE.regions[0].page_bytes
    late = replace(layer.ssm, offset=page - layer.ssm.unit_bytes * layer.ssm.units + 2)
    assert field_of(with_layer(GRANITE, 0, 0, ssm=late)) == "groups[0].layers[0].ssm"


def test_kernel_block_size_must_divide_block_size():
    assert field_of(with_group(GRANITE, ATTN, kernel_block_size=48)) == (
        f"groups[{ATTN}].kernel_block_size"
    )


def test_mamba_blocks_are_never_split():
    assert field_of(with_group(GRANITE, 0, kernel_block_size=16)) == "groups[0].kernel_block_size"


def test_layer_region_out_of_range():
    assert field_of(with_layer(GRANITE, 0, 0, region=4)) == "groups[0].layers[0].region"


@pytest.mark.parametrize(("change", "field"), [
    ({"mem": "VRAM"}, "regions[1].mem"),
    ({"mem": "VRAM", "device_id": 1}, "regions[1].mem"),
    ({"device_id": 1}, "regions[1].device_id"),  # DRAM is device 0
    ({"mem": "VRAM", "device_id": -1}, "regions[1].device_id"),
])  # fmt: skip
def test_one_ranks_regions_share_one_memory(change, field):
    """A READ's descriptor list has one NIXL memory type: a rank's regions are all in DRAM or
    all in one GPU's VRAM."""
    regions = list(GRANITE.regions)
    regions[1] = replace(regions[1], **change)
    assert field_of(replace(GRANITE, regions=regions)) == field
    gpu = [replace(r, mem="VRAM", device_id=2) for r in GRANITE.regions]
    validate_manifest(replace(GRANITE, regions=gpu))


def test_attention_unit_bytes_must_match_heads_and_kernel_block():
    layer = GRANITE.groups[ATTN].layers[0]
    half = replace(layer.k, unit_bytes=layer.k.unit_bytes // 2)
    assert (
        field_of(with_layer(GRANITE, ATTN, 0, k=half)) == f"groups[{ATTN}].layers[0].k.unit_bytes"
    )


def test_ssm_units_must_match_ssm_shape():
    layer = GRANITE.groups[0].layers[0]
    fewer = replace(layer.ssm, units=47)
    assert field_of(with_layer(GRANITE, 0, 0, ssm=fewer)) == "groups[0].layers[0].ssm.unit_bytes"


def test_conv_parts_must_hold_the_conv_shape():
    assert field_of(with_layer(GRANITE, 0, 0, conv_shape=[3328, 4])) == "groups[0].layers[0].conv"


def test_num_kv_heads_follow_the_replication_rule():
    m = plan("llama-3.1-8b", tp_size=2)
    assert field_of(with_layer(m, 0, 0, num_kv_heads=8)) == "groups[0].layers[0].num_kv_heads"


def test_pack_index_below_pack_size():
    assert field_of(with_layer(GRANITE, ATTN, 0, pack_index=1)) == (
        f"groups[{ATTN}].layers[0].pack_index"
    )


def test_identity_fields():
    assert field_of(replace(GRANITE, tp_rank=1)) == "tp_rank"
    assert field_of(replace(GRANITE, version=99)) == "version"
    region = replace(GRANITE.regions[0], num_blocks=3)
    assert field_of(replace(GRANITE, regions=[region, *GRANITE.regions[1:]])) == (
        "regions[0].num_blocks"
    )
    small = replace(GRANITE.regions[1], size_bytes=GRANITE.regions[1].size_bytes - 1)
    regions = [GRANITE.regions[0], small, *GRANITE.regions[2:]]
    assert field_of(replace(GRANITE, regions=regions)) == "regions[1].size_bytes"


def test_duplicate_layer_names():
    name = GRANITE.groups[0].layers[0].name
    assert field_of(with_layer(GRANITE, 1, 0, name=name)) == "groups[1].layers[0].name"


def test_sliding_window_only_on_sliding_groups():
    m = plan("gpt-oss-20b")
    assert field_of(with_group(m, 0, sliding_window=None)) == "groups[0].sliding_window"


@pytest.mark.parametrize("window", [0, -16])
def test_sliding_window_is_at_least_one_token(window):
    """A window of no tokens was registered, then every store lookup and load of the engine
    crashed in a 500 (StopIteration looking for the window's first chunk)."""
    m = plan("gpt-oss-20b")
    assert m.groups[0].kind == "sliding_window"
    assert field_of(with_group(m, 0, sliding_window=window)) == "groups[0].sliding_window"


def test_groups_sharing_a_kv_first_region_need_the_same_geometry():
    m = plan("gpt-oss-20b")
    layer = m.groups[1].layers[0]
    piece = layer.k.block_stride
    blocks_first = {
        "k": replace(layer.k, block_stride=2 * piece),
        "v": replace(layer.v, offset=piece, block_stride=2 * piece),
        "kv_order": "blocks_first",
    }
    assert field_of(with_layer(m, 1, 0, **blocks_first)) == "groups[1].layers[0]"


def test_large_pools_validate():
    cfg = {**load_hf_config("llama-3.1-8b"), "num_hidden_layers": 60}
    validate_manifest(plan_manifest(cfg, PlanOptions(num_blocks=100_000)))
    big = PlanOptions(num_blocks=100_000, tp_size=2, attn_pack_size=2)
    validate_manifest(plan_manifest(load_hf_config("qwen3.5-397b-a17b"), big))
