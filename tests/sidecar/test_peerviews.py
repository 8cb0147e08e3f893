"""Per-registration rank plans: computed once, recomputed for a new registration."""

from __future__ import annotations

from dataclasses import replace

import msgspec

from kvxferd.sidecar.peerviews import RankPlans
from tests.descriptors.layouts import hybrid_spec, render


def _replicated():
    # 2 KV heads over prefill TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1; no mamba.
    base = hybrid_spec()
    return replace(base, attn=replace(base.attn, total_heads=2), mamba=None, mamba_groups=())


def test_decode_rank_0_reads_one_replica_of_each_head_and_releases_the_others():
    plans = RankPlans()
    plan = plans.get(render(_replicated(), 1, 0), 4)
    assert plan.sources == (0, 2)
    assert plan.unread == (1, 3)


def test_other_decode_ranks_release_nothing():
    # Decode rank 1 of 2 holds head 1 (prefill ranks 2, 3) and reads the replica 1 % 2 = 3.
    plan = RankPlans().get(render(_replicated(), 2, 1), 4)
    assert plan.sources == (3,)
    assert plan.unread == ()


def test_a_plan_is_kept_per_registration_and_prefill_tp():
    plans = RankPlans()
    local = render(hybrid_spec(), 1, 0)
    first = plans.get(local, 2)
    assert plans.get(local, 2) is first
    assert plans.get(local, 1) is not first
    again = msgspec.structs.replace(local)  # a re-registration: a new manifest object
    assert plans.get(again, 2) is not first
    assert plans.get(again, 2) == first
