"""Dual descriptor views over pooled regions, and the logical -> descriptor id mapping."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import build_views, desc_ids, plan_read
from kvxferd.errors import BlockIdError

from . import oracle
from .layouts import AttnSpec, MambaSpec, ModelSpec, num_groups, render
from .strategies import model_specs, request_ids

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vllm_like(ratio: int = 1, **kw) -> ModelSpec:
    """2 attention layers (regions 0, 1) and 4 mamba layers (regions 0..3), 100 blocks."""
    spec = ModelSpec(
        attn=AttnSpec(total_heads=2, head_size=4, dtype="bfloat16", kbs=2, ratio=ratio,
                      head_layout="HND"),
        attn_groups=(2,),
        pack=1,
        kv_order="blocks_first",
        mamba=MambaSpec(mamba_type="mamba2", conv_layout="DS",
                        sections=(("conv_x", 2, 2), ("conv_b", 1, 1), ("conv_c", 1, 1)),
                        conv_rows=3, conv_dtype="bfloat16", ssm_units_total=2, ssm_unit_elems=4,
                        ssm_dtype="float32", ssm_gap=0),
        mamba_groups=(4,),
        pad=0,
        num_blocks=100,
    )  # fmt: skip
    return replace(spec, **kw)


def test_id_mapping_matches_vllm_hybrid_example():
    # vLLM's test_get_block_descs_ids_hybrid_ssm: FA view first, then the Mamba view.
    views = build_views(render(vllm_like()))
    assert [v.name for v in views.views] == ["fa", "mamba"]
    assert desc_ids(views, 0, [3, 5]).tolist() == [3, 5, 103, 105]
    assert desc_ids(views, 1, [1, 2]).tolist() == [201, 202, 301, 302, 401, 402, 501, 502]


def test_id_mapping_expands_logical_to_kernel_blocks():
    views = build_views(render(vllm_like(ratio=4)))
    fa, mamba = views.views
    assert (fa.num_units, fa.ratio, mamba.base) == (400, 4, 800)
    ids = desc_ids(views, 0, [3, 5]).tolist()
    assert ids == [12, 13, 14, 15, 20, 21, 22, 23, 412, 413, 414, 415, 420, 421, 422, 423]
    assert desc_ids(views, 1, [1]).tolist() == [801, 901, 1001, 1101]


def test_fa_and_mamba_views_address_the_same_pages():
    m = render(vllm_like(ratio=4))
    views = build_views(m)
    page = m.regions[0].page_bytes
    for block in (0, 7, 99):
        for group, regions in ((0, {0, 1}), (1, {0, 1, 2, 3})):
            view = views.views[views.group_view[group]]
            d = desc_ids(views, group, [block]) - view.base
            assert set(view.region[d].tolist()) == regions
            # both views see logical block `block` as the same page of each region
            assert (view.offset[d] >= block * page).all()
            assert (view.offset[d] + view.length[d] <= (block + 1) * page).all()


def test_mamba_view_slot_is_conv_plus_ssm_without_padding():
    m = render(vllm_like(pad=40))
    mamba = build_views(m).views[1]
    layer = m.groups[1].layers[0]
    conv = sum(p.units * p.unit_bytes for p in layer.conv)
    ssm = layer.ssm.units * layer.ssm.unit_bytes
    assert mamba.slot_length.tolist() == [conv + ssm] * 4
    assert m.regions[0].page_bytes > conv + ssm  # there is padding, and it is left out


@pytest.mark.parametrize(("kv_order", "pack", "slots"), [
    ("blocks_first", 1, 3),  # [K|V] per layer: one slot per region
    ("kv_first", 1, 6),  # K and V apart: two slots per region
    ("blocks_first", 3, 1),  # three layers packed in one page: one slot
    ("kv_first", 3, 2),  # three packed layers, K-first: K run and V run
])  # fmt: skip
def test_fa_slots_merge_adjacent_parts(kv_order, pack, slots):
    spec = replace(vllm_like(), attn_groups=(3,), mamba=None, mamba_groups=(), kv_order=kv_order)
    views = build_views(render(spec, pack=pack))
    assert views.views[0].num_slots == slots
    assert views.views[0].num_descriptors == slots * 100 * spec.attn.ratio


def test_groups_with_the_same_placement_share_slots():
    spec = replace(vllm_like(), attn_groups=(2, 2), mamba_groups=(4, 4))
    views = build_views(render(spec))
    assert [v.num_slots for v in views.views] == [2, 4]
    assert views.group_view == (0, 0, 1, 1)
    np.testing.assert_array_equal(views.group_slots[0], views.group_slots[1])
    np.testing.assert_array_equal(views.group_slots[2], views.group_slots[3])


def test_desc_ids_validate_ids():
    views = build_views(render(vllm_like()))
    with pytest.raises(BlockIdError) as exc:
        desc_ids(views, 1, [4, 100])
    assert exc.value.field == "block_ids[1][1]"
    with pytest.raises(BlockIdError) as exc:
        desc_ids(views, 0, [4, 9, 4])
    assert exc.value.field == "block_ids[0][2]"
    with pytest.raises(BlockIdError) as exc:
        desc_ids(views, 2, [1])
    assert exc.value.field == "block_ids"


@st.composite
def requests(draw):
    spec = draw(model_specs())
    m = render(spec)
    return m, draw(request_ids(num_groups(spec), m.num_blocks))


@SETTINGS
@given(requests())
def test_view_descriptors_of_a_request_are_exactly_its_bytes(case):
    m, ids = case
    views = build_views(m)
    region, offset, length = views.table()
    assert region.size == views.num_descriptors
    d = np.concatenate([desc_ids(views, g, i) for g, i in enumerate(ids)])
    pos = oracle.expand(oracle.region_bases(m), region[d], offset[d], length[d])
    want = oracle.label_bytes(m, ids)
    hits = np.bincount(pos, minlength=want.size)
    np.testing.assert_array_equal(hits, (want >= 0).astype(np.int64))


@SETTINGS
@given(requests())
def test_view_descriptors_equal_the_uncoalesced_plan_at_equal_layout(case):
    m, ids = case
    views = build_views(m)
    region, offset, length = views.table()
    d = np.concatenate([desc_ids(views, g, i) for g, i in enumerate(ids)])
    plan = plan_read(m, m, ids, ids, coalesce=False)
    from_views = sorted(zip(region[d].tolist(), offset[d].tolist(), length[d].tolist(),
                            strict=True))  # fmt: skip
    from_plan = sorted(zip(plan.local_region.tolist(), plan.local_offset.tolist(),
                           plan.length.tolist(), strict=True))  # fmt: skip
    assert from_views == from_plan


def test_large_pool_tables_have_the_right_shape():
    spec = replace(vllm_like(), attn_groups=(30,), mamba_groups=(60,), num_blocks=100_000)
    views = build_views(render(spec))
    fa, mamba = views.views
    assert (fa.num_slots, mamba.num_slots) == (30, 60)
    assert mamba.region.size == 60 * 100_000
    assert mamba.offset[-1] == mamba.slot_offset[-1] + 99_999 * mamba.slot_stride[-1]
