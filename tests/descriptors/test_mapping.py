"""plan_read at equal TP: a request's descriptors are exactly its blocks' bytes, paired right."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import compare_manifests, plan_pull, plan_read, read_geometry
from kvxferd.errors import BlockIdError, IncompatiblePeerError, ManifestError
from kvxferd.wire import AttentionLayer

from . import oracle
from .layouts import ModelSpec, hybrid_spec, num_groups, render
from .strategies import model_specs, paired_ids

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_exact_copy(local, remote, lids, rids, plan) -> None:
    """Every requested byte is written once, from the remote byte that is the same thing."""
    want_local = oracle.label_bytes(local, lids)
    want_remote = oracle.label_bytes(remote, rids)
    lpos = oracle.local_positions(local, plan)
    rpos = oracle.remote_positions(remote, plan)
    assert (want_local[lpos] >= 0).all(), "a descriptor writes a byte outside the request"
    np.testing.assert_array_equal(want_local[lpos], want_remote[rpos])
    hits = np.bincount(lpos, minlength=want_local.size)
    np.testing.assert_array_equal(hits, (want_local >= 0).astype(np.int64))


@st.composite
def pairs(draw, same_layout: bool = False):
    spec: ModelSpec = draw(model_specs())
    remote_blocks = draw(st.integers(2, 64))
    local = render(spec)
    remote = (
        render(spec, num_blocks=remote_blocks)
        if same_layout
        else render(
            spec,
            num_blocks=remote_blocks,
            kv_order=draw(st.sampled_from(["kv_first", "blocks_first"])),
            pack=draw(st.integers(1, 3)),
        )
    )
    lids, rids = draw(paired_ids(num_groups(spec), local.num_blocks, remote.num_blocks))
    return local, remote, lids, rids


@SETTINGS
@given(pairs(), st.booleans())
def test_plan_covers_exactly_the_requested_bytes(case, coalesce):
    local, remote, lids, rids = case
    plan = plan_read(local, remote, lids, rids, coalesce=coalesce)
    assert_exact_copy(local, remote, lids, rids, plan)
    assert plan.total_bytes == int(plan.length.sum())


@SETTINGS
@given(pairs())
def test_kv_and_state_bytes_split_by_group_kind(case):
    local, remote, lids, rids = case
    plan = plan_read(local, remote, lids, rids)
    kv = state = 0
    for group, ids in zip(local.groups, lids, strict=True):
        one = oracle.label_bytes(local, [ids if g is group else ids[:0] for g in local.groups])
        n = int((one >= 0).sum())
        if group.kind == "mamba":
            state += n
        else:
            kv += n
    assert (plan.kv_bytes, plan.state_bytes) == (kv, state)


def test_hybrid_example_is_one_descriptor_per_layer_and_block_before_coalescing():
    m = render(hybrid_spec())
    lids = [np.array([1, 3]), np.array([5]), np.array([7, 9])]
    rids = [np.array([2, 4]), np.array([6]), np.array([8, 10])]
    plan = plan_read(m, m, lids, rids, coalesce=False)
    # attention: [K|V] merged per kernel block: 2 layers x 2 ids x ratio 2; mamba: [conv|ssm]
    # merged per layer and logical block: 2 layers x 3 ids.
    assert plan.num_descriptors == 2 * 2 * 2 + 2 * 3
    assert_exact_copy(m, m, lids, rids, plan)


def test_coalescing_joins_consecutive_blocks_on_both_sides():
    m = render(replace(hybrid_spec(), pad=0))
    ids = [np.array([4, 5, 6]), np.array([], dtype=np.int64), np.array([], dtype=np.int64)]
    plan = plan_read(m, m, ids, ids)
    # kernel blocks 8..13 of each layer are one run (no padding between kernel blocks)
    assert plan.num_descriptors == 2
    assert plan.kv_bytes == 2 * 3 * 2 * (2 * 4 * 2 * 4 * 2)


def test_ids_out_of_range_name_the_entry():
    m = render(hybrid_spec())
    good = [np.array([1]), np.array([2]), np.array([3])]
    bad = [np.array([1]), np.array([2, 20]), np.array([3])]
    with pytest.raises(BlockIdError) as exc:
        plan_read(m, m, bad, good)
    assert exc.value.field == "block_ids[1][1]"
    with pytest.raises(BlockIdError) as exc:
        plan_read(m, m, good, [np.array([1]), np.array([-1]), np.array([3])])
    assert exc.value.field == "remote_block_ids[1][0]"


def test_duplicate_ids_in_a_group_name_the_repeat():
    m = render(hybrid_spec())
    with pytest.raises(BlockIdError) as exc:
        ids = [np.array([1, 4, 5, 4]), np.array([2]), np.array([3])]
        plan_read(m, m, ids, ids)
    assert exc.value.field == "block_ids[0][3]"
    assert "block_ids[0][1]" in str(exc.value)


def test_length_mismatch_and_group_count_are_block_id_errors():
    m = render(hybrid_spec())
    ids = [np.array([1]), np.array([2]), np.array([3])]
    with pytest.raises(BlockIdError) as exc:
        plan_read(m, m, ids, [np.array([1]), np.array([2, 4]), np.array([3])])
    assert exc.value.field == "remote_block_ids[1]"
    with pytest.raises(BlockIdError) as exc:
        plan_read(m, m, ids[:2], ids)
    assert exc.value.field == "block_ids"
    with pytest.raises(BlockIdError) as exc:
        plan_read(m, m, [np.array([1.0]), *ids[1:]], ids)
    assert exc.value.field == "block_ids[0]"


def test_compare_manifests_lists_every_disagreement():
    spec = hybrid_spec()
    a = render(spec)
    b = render(replace(spec, attn=replace(spec.attn, head_size=8, dtype="float16")))
    diff = compare_manifests(a, b)
    assert diff["groups[0].layers[0].head_size"] == (4, 8)
    assert diff["groups[0].layers[1].dtype"] == ("bfloat16", "float16")
    assert "groups[0].layers[0].k.unit_bytes" in diff
    with pytest.raises(IncompatiblePeerError) as exc:
        plan_read(a, b, [[1], [2], [3]], [[1], [2], [3]])
    assert exc.value.fields == diff
    assert compare_manifests(a, render(spec, num_blocks=7)) == {}


def test_compare_manifests_group_structure():
    spec = hybrid_spec()
    a, b = render(spec), render(replace(spec, mamba_groups=(2,)))
    assert compare_manifests(a, b) == {"groups": (3, 2)}
    c = render(replace(spec, attn_groups=(1,)))
    assert compare_manifests(a, c)["groups[0].layers"] == (2, 1)


def test_part_outside_its_region_is_a_manifest_error():
    m = render(hybrid_spec())
    layer = m.groups[0].layers[1]
    assert isinstance(layer, AttentionLayer)
    bad_v = msgspec.structs.replace(layer.v, block_stride=layer.v.block_stride * 2)
    bad_layer = msgspec.structs.replace(layer, v=bad_v)
    g0 = msgspec.structs.replace(m.groups[0], layers=[m.groups[0].layers[0], bad_layer])
    bad = msgspec.structs.replace(m, groups=[g0, *m.groups[1:]])
    with pytest.raises(ManifestError) as exc:
        plan_read(m, bad, [[1], [], []], [[1], [], []])
    assert exc.value.field == "remote.groups[0].layers[1].v"
    with pytest.raises(ManifestError) as exc:
        plan_read(bad, m, [[1], [], []], [[1], [], []])
    assert exc.value.field == "groups[0].layers[1].v"


@pytest.mark.parametrize("stride", ["block_stride", "row_stride"])
def test_a_peer_stride_past_int64_is_a_manifest_error_not_an_overflow(stride):
    """A stride that multiplies only 0 (one block unit, one row) never meets the region bounds:
    a peer's 2**64 - 1 there passed the handshake, then every pull from it failed with an
    OverflowError building its int64 descriptors."""
    m = render(hybrid_spec())
    one = render(hybrid_spec(), num_blocks=1)
    g = next(i for i, group in enumerate(one.groups) if group.kind == "mamba")  # 1 unit a block
    layer = one.groups[g].layers[0]
    assert layer.ssm.rows == 1
    bad_ssm = msgspec.structs.replace(layer.ssm, **{stride: (1 << 64) - 1})
    layers = [msgspec.structs.replace(layer, ssm=bad_ssm), *one.groups[g].layers[1:]]
    groups = list(one.groups)
    groups[g] = msgspec.structs.replace(groups[g], layers=layers)
    bad = msgspec.structs.replace(one, groups=groups)
    for call in (lambda: compare_manifests(m, bad), lambda: read_geometry(m, bad)):
        with pytest.raises(ManifestError) as exc:
            call()
        assert exc.value.field == f"remote.groups[{g}].layers[0].ssm"


def test_cached_peer_geometry_plans_like_plan_read():
    from kvxferd.descriptors import read_geometry

    local, remote = render(hybrid_spec(), 2, 1), render(hybrid_spec(), 1, 0, num_blocks=9)
    lids = [np.array([1, 2]), np.array([3]), np.array([4])]
    rids = [np.array([8, 7]), np.array([0]), np.array([5])]
    geo = read_geometry(local, remote)
    for coalesce in (False, True):
        a = geo.plan(lids, rids, coalesce=coalesce)
        b = plan_read(local, remote, lids, rids, coalesce=coalesce)
        for f in ("local_region", "local_offset", "remote_region", "remote_offset", "length"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert (a.kv_bytes, a.state_bytes) == (b.kv_bytes, b.state_bytes)
    with pytest.raises(BlockIdError) as exc:
        geo.plan(lids, [np.array([8, 9]), *rids[1:]])
    assert exc.value.field == "remote_block_ids[0][1]"


def test_a_pull_whose_local_ids_were_checked_plans_the_same_and_still_checks_remote_ids():
    m = render(hybrid_spec())
    geometry = read_geometry(m, m)
    lids, rids = [[1, -1, 4], [2], [3]], [[5, 6, 7], [8], [9]]
    want = plan_pull(geometry, lids, rids)
    got = plan_pull(geometry, lids, rids, local_checked=True)
    for a, b in zip(
        (want.local_region, want.local_offset, want.remote_offset, want.length),
        (got.local_region, got.local_offset, got.remote_offset, got.length),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(BlockIdError) as exc:
        plan_pull(geometry, lids, [[5, 6, 7], [m.num_blocks], [9]], local_checked=True)
    assert exc.value.field == "remote_block_ids[1][0]"
    with pytest.raises(BlockIdError) as exc:
        plan_pull(geometry, lids[:2], rids[:2], local_checked=True)
    assert exc.value.field == "block_ids"
