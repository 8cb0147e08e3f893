"""Heterogeneous TP: who holds which unit, who reads it from whom, and that bytes land right."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import (
    compare_manifests,
    expected_readers,
    owned_units,
    plan_read,
    source_ranks,
    unit_holders,
)
from kvxferd.errors import IncompatiblePeerError, ManifestError

from . import oracle
from .layouts import hybrid_spec, num_groups, render
from .strategies import model_specs, paired_ids

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# (local tp, remote tp), heterogeneous pairs first so that shrinking keeps them
TP_PAIRS = st.sampled_from([(4, 2), (2, 4), (1, 4), (4, 1), (1, 2), (2, 1), (4, 4), (2, 2), (1, 1)])


def test_ownership_splits_evenly_or_replicates():
    assert owned_units(8, 2, 1) == range(4, 8)
    assert owned_units(4, 4, 3) == range(3, 4)
    assert owned_units(2, 8, 5) == range(1, 2)  # 4 ranks share each unit
    assert unit_holders(2, 8, 1) == range(4, 8)
    assert unit_holders(8, 2, 5) == range(1, 2)


@pytest.mark.parametrize(("units", "tp"), [(3, 2), (6, 4)])
def test_ownership_without_split_or_replication_is_a_manifest_error(units, tp):
    with pytest.raises(ManifestError, match=f"{units} TP units"):
        owned_units(units, tp, 0)


def test_units_that_break_the_rule_name_the_part():
    m = render(hybrid_spec(), tp_size=2, tp_rank=0)
    layer = m.groups[0].layers[0]
    bad = msgspec.structs.replace(layer, k=msgspec.structs.replace(layer.k, units=1))
    g0 = msgspec.structs.replace(m.groups[0], layers=[bad, m.groups[0].layers[1]])
    bad_m = msgspec.structs.replace(m, groups=[g0, *m.groups[1:]])
    with pytest.raises(ManifestError) as exc:
        compare_manifests(bad_m, m)
    assert exc.value.field == "groups[0].layers[0].k.units"


def all_plans(spec, tp_l, tp_r, lids, rids, nb_l, nb_r):
    """plan_read for every (local rank, remote rank) pair."""
    local = [render(spec, tp_l, r, num_blocks=nb_l) for r in range(tp_l)]
    remote = [render(spec, tp_r, r, num_blocks=nb_r) for r in range(tp_r)]
    plans = {(i, j): plan_read(a, b, lids, rids) for i, a in enumerate(local) for j, b in
             enumerate(remote)}  # fmt: skip
    return local, remote, plans


@st.composite
def hetero_cases(draw, min_units: int):
    spec = draw(model_specs(min_units=min_units, head_layout="HND", conv_layout="DS",
                            max_blocks=24))  # fmt: skip
    nb_l, nb_r = draw(st.integers(2, 24)), draw(st.integers(2, 24))
    min_ids = draw(st.sampled_from([1, 0]))
    lids, rids = draw(paired_ids(num_groups(spec), nb_l, nb_r, max_ids=6, min_ids=min_ids))
    tp_l, tp_r = draw(TP_PAIRS)
    return spec, tp_l, tp_r, lids, rids, nb_l, nb_r


def check_hetero(case, remote_once: bool) -> None:
    spec, tp_l, tp_r, lids, rids, nb_l, nb_r = case
    local, remote, plans = all_plans(spec, tp_l, tp_r, lids, rids, nb_l, nb_r)
    want_l = [oracle.label_bytes(m, lids) for m in local]
    want_r = [oracle.label_bytes(m, rids) for m in remote]
    remote_hits = [np.zeros(w.size, dtype=np.int64) for w in want_r]
    read_labels = []
    for i, m_l in enumerate(local):
        hits = np.zeros(want_l[i].size, dtype=np.int64)
        for j, m_r in enumerate(remote):
            plan = plans[i, j]
            lpos = oracle.local_positions(m_l, plan)
            rpos = oracle.remote_positions(m_r, plan)
            assert (want_l[i][lpos] >= 0).all()
            # same group, layer, part, GLOBAL unit, byte, block slot on both sides
            np.testing.assert_array_equal(want_l[i][lpos], want_r[j][rpos])
            hits += np.bincount(lpos, minlength=hits.size)
            remote_hits[j] += np.bincount(rpos, minlength=remote_hits[j].size)
            read_labels.append(want_r[j][rpos])
        # every local byte of the request is written exactly once, over all remote ranks
        np.testing.assert_array_equal(hits, (want_l[i] >= 0).astype(np.int64))
        reading = [j for j in range(tp_r) if plans[i, j].num_descriptors]
        assert set(reading) <= set(source_ranks(m_l, tp_r))
        if all(ids.size for ids in lids):  # every group (so every part) takes part
            assert source_ranks(m_l, tp_r) == reading
    # each thing is read as many times as local ranks hold it (once each)
    got = np.unique(np.concatenate(read_labels), return_counts=True)
    held = np.concatenate([w[w >= 0] for w in want_l])
    want = np.unique(held, return_counts=True)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    for j, m_r in enumerate(remote):
        readers = sum(1 for i in range(tp_l) if plans[i, j].num_descriptors)
        assert readers <= expected_readers(m_r, tp_l)
        if all(ids.size for ids in lids):
            assert expected_readers(m_r, tp_l) == readers
        if remote_once:
            np.testing.assert_array_equal(remote_hits[j], (want_r[j] >= 0).astype(np.int64))


@SETTINGS
@given(hetero_cases(min_units=4))
def test_hetero_tp_reads_every_remote_byte_once_into_its_place(case):
    check_hetero(case, remote_once=True)


@SETTINGS
@given(hetero_cases(min_units=1))
def test_hetero_tp_with_replicated_units_reads_each_local_unit_once(case):
    check_hetero(case, remote_once=False)


def test_decode_tp4_reads_its_head_slice_of_a_prefill_tp2_rank():
    spec = hybrid_spec()  # 4 KV heads: P rank 1 holds heads 2,3; D rank 3 holds head 3
    local, remote = render(spec, 4, 3), render(spec, 2, 1)
    ids = [np.array([5]), np.array([], dtype=np.int64), np.array([], dtype=np.int64)]
    plan = plan_read(local, remote, ids, ids, coalesce=False)
    k = remote.groups[0].layers[0].k
    head = k.unit_bytes
    kernel = 5 * 2  # logical 5, ratio 2 -> kernel blocks 10, 11
    assert plan.num_descriptors == 2 * 2 * 2  # layers x kernel blocks x (K, V)
    assert k.offset + kernel * k.block_stride + 1 * head in plan.remote_offset.tolist()
    assert set(plan.length.tolist()) == {head}
    assert source_ranks(local, 2) == [1]
    assert expected_readers(remote, 4) == 2


def test_prefill_rank_serving_only_replicas_expects_no_readers():
    # 2 KV heads over P tp4: ranks 0,1 hold head 0; ranks 2,3 hold head 1. D tp1 reads each
    # head from one replica, but mamba units (4) are split over all four P ranks.
    spec = replace(hybrid_spec(), attn=replace(hybrid_spec().attn, total_heads=2), mamba=None,
                   mamba_groups=())  # fmt: skip
    assert [expected_readers(render(spec, 4, r), 1) for r in range(4)] == [1, 0, 1, 0]
    assert source_ranks(render(spec, 1, 0), 4) == [0, 2]


def test_nhd_attention_cannot_be_sliced_across_tp():
    spec = hybrid_spec()
    nhd = replace(spec, attn=replace(spec.attn, head_layout="NHD"))
    local, remote = render(nhd, 4, 0), render(nhd, 2, 0)
    diff = compare_manifests(local, remote)
    assert diff["groups[0].layers[0].k.sliceable"] == (False, False)
    assert "groups[0].layers[1].v.sliceable" in diff
    with pytest.raises(IncompatiblePeerError, match=r"groups\[0\]\.layers\[0\]\.k\.sliceable"):
        plan_read(local, remote, [[1], [], []], [[1], [], []])
    # equal TP needs no slice: fine
    assert compare_manifests(render(nhd, 2, 1), render(nhd, 2, 1)) == {}


def test_nhd_attention_with_replicated_heads_needs_no_slice():
    spec = hybrid_spec()
    nhd = replace(spec, attn=replace(spec.attn, head_layout="NHD", total_heads=1), mamba=None,
                  mamba_groups=())  # fmt: skip
    local, remote = render(nhd, 4, 3), render(nhd, 2, 1)
    assert compare_manifests(local, remote) == {}
    plan = plan_read(local, remote, [[2]], [[3]])
    assert plan.kv_bytes > 0


def test_sd_conv_cannot_be_sliced_across_tp():
    spec = hybrid_spec()
    sd = replace(
        spec,
        mamba=replace(spec.mamba, conv_layout="SD",
                      sections=(("conv_x", 4, 2), ("conv_b", 4, 4), ("conv_c", 4, 4))),
    )  # fmt: skip
    local, remote = render(sd, 2, 0), render(sd, 1, 0)
    diff = compare_manifests(local, remote)
    assert diff == {
        "groups[1].layers[0].conv[0].sliceable": (False, False),
        "groups[1].layers[1].conv[0].sliceable": (False, False),
        "groups[2].layers[0].conv[0].sliceable": (False, False),
        "groups[2].layers[1].conv[0].sliceable": (False, False),
    }


def test_rank_helpers_reject_a_tp_size_the_units_cannot_follow():
    m = render(hybrid_spec())  # 4 KV heads, 4 mamba heads, 2 B/C groups
    with pytest.raises(ManifestError, match="tp_size 3"):
        source_ranks(m, 3)
    with pytest.raises(ManifestError, match="tp_size 3"):
        expected_readers(m, 3)


@pytest.mark.parametrize("local_tp", [1, 2, 4])
@pytest.mark.parametrize("remote_tp", [1, 2, 4])
def test_source_ranks_are_the_union_of_every_parts_sources(local_tp, remote_tp):
    # The fast path looks at distinct unit totals only; the union over every part must agree.
    spec = replace(hybrid_spec(), attn=replace(hybrid_spec().attn, total_heads=2))
    for rank in range(local_tp):
        m = render(spec, local_tp, rank)
        want: set[int] = set()
        for g in m.groups:
            for layer in g.layers:
                parts = [layer.k, layer.v] if hasattr(layer, "k") else [*layer.conv, layer.ssm]
                for p in parts:
                    for u in owned_units(p.units_total, local_tp, rank):
                        holders = unit_holders(p.units_total, remote_tp, u)
                        want.add(holders[rank % len(holders)])
        assert source_ranks(m, remote_tp) == sorted(want)
