"""The stacked fan-in plan: every prefill rank's plan is exactly the one it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

from kvxferd.descriptors import plan_pull, read_geometry, source_ranks
from kvxferd.descriptors.fanin import fan_in_geometry
from kvxferd.errors import BlockIdError

from .layouts import hybrid_spec, num_groups, render
from .test_tpslice import SETTINGS, hetero_cases

FIELDS = ("local_region", "local_offset", "remote_region", "remote_offset", "length")


def assert_same_plan(got, want) -> None:
    for f in FIELDS:
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
    assert (got.kv_bytes, got.state_bytes) == (want.kv_bytes, want.state_bytes)


@SETTINGS
@given(hetero_cases(min_units=1))
def test_each_ranks_plan_is_its_plan_alone(case):
    spec, tp_l, tp_r, lids, rids, nb_l, nb_r = case
    for lr in range(tp_l):
        local = render(spec, tp_l, lr, num_blocks=nb_l)
        ranks = source_ranks(local, tp_r)
        geometries = [read_geometry(local, render(spec, tp_r, r, num_blocks=nb_r)) for r in ranks]
        fan = fan_in_geometry(geometries)
        assert fan is not None
        plans = fan.plan(lids, rids)
        assert len(plans) == len(geometries)
        for got, geometry in zip(plans, geometries, strict=True):
            assert_same_plan(got, plan_pull(geometry, lids, rids))


def test_a_tp8_fan_in_reads_each_ranks_own_slice():
    spec = hybrid_spec()
    local = render(spec, 1, 0)
    geometries = [read_geometry(local, render(spec, 8, r)) for r in source_ranks(local, 8)]
    ids = [np.arange(3, dtype=np.int64) + 3 * g for g in range(num_groups(spec))]  # disjoint
    plans = fan_in_geometry(geometries).plan(ids, ids)
    assert len(plans) == len(geometries) > 1
    for got, geometry in zip(plans, geometries, strict=True):
        assert got.num_descriptors > 0
        assert_same_plan(got, plan_pull(geometry, ids, ids))
    # no two ranks write the same local byte
    spans = sorted(
        (int(r), int(o), int(o + n))
        for p in plans
        for r, o, n in zip(p.local_region, p.local_offset, p.length, strict=True)
    )
    for (r0, _, e0), (r1, s1, _) in zip(spans, spans[1:], strict=False):
        assert r0 != r1 or e0 <= s1


def test_ranks_that_cannot_share_a_plan_are_refused():
    spec = hybrid_spec()
    local = render(spec, 1, 0)
    one = read_geometry(local, render(spec, 2, 0))
    other_pool = read_geometry(local, render(spec, 2, 1, num_blocks=spec.num_blocks + 1))
    assert fan_in_geometry([]) is None
    assert fan_in_geometry([one, other_pool]) is None
    assert fan_in_geometry([one, read_geometry(local, render(spec, 2, 1))]) is not None


def test_bad_ids_name_the_field_as_plan_pull_does():
    spec = hybrid_spec()
    local = render(spec, 1, 0)
    fan = fan_in_geometry([read_geometry(local, render(spec, 2, r)) for r in range(2)])
    ids = [[0] for _ in range(num_groups(spec))]
    bad = [[spec.num_blocks] for _ in range(num_groups(spec))]
    with pytest.raises(BlockIdError) as exc:
        fan.plan(ids, bad)
    assert exc.value.field.startswith("remote_block_ids")
    with pytest.raises(BlockIdError) as exc:
        fan.plan(bad, ids)
    assert exc.value.field.startswith("block_ids")
