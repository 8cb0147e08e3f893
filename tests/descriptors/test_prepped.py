"""Prepared tables and index plans: a request indexed into them moves exactly its plan's bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import (
    ReadPlan,
    coalesce,
    plan_pull,
    plan_read,
    prepped_geometry,
    read_geometry,
)
from kvxferd.errors import BlockIdError

from .layouts import hybrid_spec, num_groups, render
from .test_mapping import assert_exact_copy, pairs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def as_plan(prepped, idx) -> ReadPlan:
    """The byte pairs an index plan addresses, in the coalescing layer's terms."""
    (lr, lo, ll), (rr, ro, rl) = prepped.local, prepped.remote
    li, ri = idx.local_idx.astype(np.int64), idx.remote_idx.astype(np.int64)
    np.testing.assert_array_equal(ll[li], rl[ri])  # paired rows have equal lengths
    return ReadPlan(lr[li], lo[li], rr[ri], ro[ri], ll[li], idx.kv_bytes, idx.state_bytes)


@SETTINGS
@given(pairs())
def test_index_plan_moves_exactly_the_coalesced_plans_bytes(case):
    local, remote, lids, rids = case
    prepped = prepped_geometry(read_geometry(local, remote))
    assert prepped is not None
    idx = prepped.plan(lids, rids)
    want = plan_read(local, remote, lids, rids)
    got = as_plan(prepped, idx)
    assert_exact_copy(local, remote, lids, rids, got)
    assert (idx.kv_bytes, idx.state_bytes) == (want.kv_bytes, want.state_bytes)
    merged = coalesce(got)
    for f in ("local_region", "local_offset", "remote_region", "remote_offset", "length"):
        np.testing.assert_array_equal(getattr(merged, f), getattr(want, f))
    assert want.num_descriptors <= idx.runs <= idx.num_descriptors


@SETTINGS
@given(pairs(same_layout=True), st.data())
def test_skipped_local_ids_are_left_out_like_plan_pull(case, data):
    local, remote, lids, rids = case
    skip = [data.draw(st.lists(st.booleans(), min_size=a.size, max_size=a.size)) for a in lids]
    lo = [
        [-1 if s else int(b) for b, s in zip(a, sk, strict=True)]
        for a, sk in zip(lids, skip, strict=True)
    ]
    geometry = read_geometry(local, remote)
    prepped = prepped_geometry(geometry)
    idx = prepped.plan(lo, [r.tolist() for r in rids])
    want = plan_pull(geometry, lo, [r.tolist() for r in rids])
    assert idx.total_bytes == want.total_bytes
    assert int(prepped.local[2][idx.local_idx].sum()) == want.total_bytes


def test_groups_of_a_pool_share_rows_and_indices_are_int32():
    spec = hybrid_spec()
    m = render(spec)
    prepped = prepped_geometry(read_geometry(m, m))
    distinct = {id(g) for g in prepped.groups if g is not None}
    assert len(distinct) < len(m.groups)  # the mamba groups of the pool share their rows
    ids = [np.array([1, 2])] * num_groups(spec)
    idx = prepped.plan(ids, ids)
    assert idx.local_idx.dtype == np.int32 and idx.remote_idx.dtype == np.int32


def test_a_pair_too_large_to_prep_is_not_prepped():
    m = render(hybrid_spec())
    assert prepped_geometry(read_geometry(m, m), max_rows=4) is None


def test_bad_ids_name_the_field():
    m = render(hybrid_spec())
    prepped = prepped_geometry(read_geometry(m, m))
    n = num_groups(hybrid_spec())
    with pytest.raises(BlockIdError) as err:
        prepped.plan([[m.num_blocks]] + [[]] * (n - 1), [[0]] + [[]] * (n - 1))
    assert err.value.field == "block_ids[0][0]"
    with pytest.raises(BlockIdError) as err:
        prepped.plan([[0]] * n, [[0, 1]] + [[0]] * (n - 1))
    assert err.value.field == "block_ids[0]"


@SETTINGS
@given(pairs(), st.data())
def test_the_cheaper_of_index_and_coalesced_plan_never_posts_more_than_the_coalesced_plan(
    case, data
):
    # Random layouts and block lists (runs, shuffles, adjacency across groups of one pool), some
    # local ids skipped: what a prepped pull posts is never more than plan_pull's descriptors.
    local, remote, lids, rids = case
    skip = data.draw(st.booleans())
    lo = [[-1 if skip and data.draw(st.booleans()) else int(b) for b in a] for a in lids]
    geometry = read_geometry(local, remote)
    prepped = prepped_geometry(geometry)
    ro = [r.tolist() for r in rids]
    idx = prepped.plan(lo, ro)
    want = plan_pull(geometry, lo, ro)
    merged = prepped.cheaper(idx)
    posted = idx.num_descriptors if merged is None else merged.num_descriptors
    assert posted <= want.num_descriptors
    if merged is not None:  # posted as tables: exactly the coalesced plan
        assert merged.num_descriptors < idx.num_descriptors
        for f in ("local_region", "local_offset", "remote_region", "remote_offset", "length"):
            np.testing.assert_array_equal(getattr(merged, f), getattr(want, f))
        assert (merged.kv_bytes, merged.state_bytes) == (want.kv_bytes, want.state_bytes)


def test_a_run_of_blocks_is_posted_coalesced_and_a_scatter_by_index():
    # The bench's GDN hybrid: one pool, 12 regions; a run of blocks coalesces, a scatter not.
    from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest

    m = plan_manifest(load_hf_config("qwen3-next-80b-a3b"), PlanOptions(num_blocks=16))
    geometry = read_geometry(m, m)
    prepped = prepped_geometry(geometry)
    run = [[1] if g.kind == "mamba" else [2, 3] for g in m.groups]
    scatter = [[1] if g.kind == "mamba" else [3, 5] for g in m.groups]
    idx = prepped.plan(run, run)
    merged = prepped.cheaper(idx)
    assert merged is not None
    assert merged.num_descriptors == plan_pull(geometry, run, run).num_descriptors
    assert merged.num_descriptors < idx.num_descriptors
    idx = prepped.plan(scatter, scatter)
    assert prepped.cheaper(idx) is None
    assert idx.num_descriptors == plan_pull(geometry, scatter, scatter).num_descriptors
