"""A decode pulling from eight prefill ranks stages its READ: each rank's blocks are read whole
into the staging buffer and scattered into place, byte-exact, over real NIXL.

One pod sidecar (``serve --pod-ranks 8``) serves prefill TP 8 of scripts/bench_pulls.py's
hybrid (8 KV heads, 6 Mamba2 layers); decode TP 1 sidecars read from it: two with the default
staging buffer, one with staging off (``--staging-bytes 0``), one whose buffer holds one pull.
Every byte of every layer of every block read is checked, and nothing outside those blocks
(padding, other blocks) changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvxferd.pattern import verify_pattern
from kvxferd.wire import PullRequest
from tests.sidecar.harness import (
    QUIET,
    EnginePool,
    EngineRank,
    changed_outside,
    start_sidecars,
    wait_no_handles,
    wait_until,
)
from tests.sidecar.stagedpod import (
    NUM_BLOCKS,
    ONE_PULL,
    SLOT,
    SLOTS,
    TP,
    hold,
    pull,
    ranks,
    reads,
    slot,
    staged_pull,
)

pytestmark = pytest.mark.nixl


@dataclass
class Cluster:
    pod: list[EngineRank]
    staged: EngineRank  # default staging buffer
    direct: EngineRank  # --staging-bytes 0
    small: EngineRank  # a buffer of one pull
    fresh: EngineRank  # default staging buffer, for one test only


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("staged"))
    pod_sidecar = start_sidecars(tmp, ["pod"], "--pod-ranks", str(TP), env=QUIET)[0]
    sidecars = [pod_sidecar]
    pools: list[EnginePool] = []
    try:
        sidecars += [
            *start_sidecars(tmp, ["staged"], env=QUIET),
            *start_sidecars(tmp, ["direct"], "--staging-bytes", "0", env=QUIET),
            *start_sidecars(tmp, ["small"], "--staging-bytes", str(ONE_PULL), env=QUIET),
            *start_sidecars(tmp, ["fresh"], env=QUIET),
        ]
        pod, decodes = ranks(pod_sidecar, sidecars[1:], pools)
        yield Cluster(pod, *decodes)
    finally:
        codes = [s.stop() for s in sidecars]
        for pool in pools:
            pool.close()
    assert codes == [0] * len(sidecars)


def _fragmented(seed: int) -> list[list[int]]:
    """A pull's decode ids scattered over the whole pool (never in block order)."""
    ids = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))[: sum(SLOT)]
    return [ids[a:b].tolist() for a, b in zip(np.cumsum([0, *SLOT[:-1]]), np.cumsum(SLOT),
                                              strict=True)]  # fmt: skip


def test_a_pull_from_eight_pod_ranks_is_staged_and_every_byte_lands_in_place(cluster):
    status = staged_pull(cluster.pod, cluster.staged, slot(0), slot(1), seed=100)
    assert status.descriptors == TP * 2  # one run per rank and region, not 304 rows
    wait_no_handles(cluster.staged.sidecar, cluster.pod[0].sidecar)


def test_the_first_pull_reads_direct_while_the_staging_buffer_registers(cluster):
    fresh = cluster.fresh
    status = pull(cluster.pod, fresh, slot(0), slot(1), seed=150)  # its tables built on demand
    assert status.descriptors == 304
    assert (reads(fresh, "tables"), reads(fresh, "staged")) == (1, 0)
    status = staged_pull(cluster.pod, fresh, slot(2), slot(3), seed=160)
    assert status.descriptors == TP * 2


def test_a_staged_pull_scatters_into_fragmented_decode_blocks(cluster):
    staged_pull(cluster.pod, cluster.staged, slot(0), slot(1), seed=200)  # registered
    for seed in (7, 8, 9):
        staged = reads(cluster.staged, "staged")
        pull(cluster.pod, cluster.staged, _fragmented(seed), slot(2), seed=300 + seed)
        assert reads(cluster.staged, "staged") == staged + 1


def test_with_staging_off_the_same_pull_reads_direct(cluster):
    tables = reads(cluster.direct, "tables")
    status = pull(cluster.pod, cluster.direct, slot(0), slot(1), seed=400)
    assert status.descriptors == 304
    assert reads(cluster.direct, "tables") == tables + 1
    assert reads(cluster.direct, "staged") == 0


def test_pulls_that_find_the_staging_buffer_full_read_direct(cluster):
    small = cluster.small
    staged_pull(cluster.pod, small, slot(0), slot(1), seed=500)  # the buffer is registered
    staged, tables = reads(small, "staged"), reads(small, "tables")
    holds = [(slot(s), slot((s + 1) % SLOTS), 600 + s) for s in range(SLOTS)]
    tickets = [hold(cluster.pod, pids, seed) for _, pids, seed in holds]
    befores = small.pool.snapshot()
    with small.sidecar.client() as c:  # all in flight at once: one fits the buffer
        accepted = [c.pull(PullRequest(tickets=[t], block_ids=ids, deadline_s=60))
                    for t, (ids, _, _) in zip(tickets, holds, strict=True)]  # fmt: skip
        statuses = [c.wait_pull(a.pull_id, timeout_s=90) for a in accepted]
    assert [s.state for s in statuses] == ["done"] * SLOTS, statuses
    for ids, _, seed in holds:
        assert verify_pattern(small.manifest, small.pool.views, ids, seed=seed) is None
    every = [sorted(b for ids, _, _ in holds for b in ids[g]) for g in range(len(SLOT))]
    assert changed_outside(befores, small.pool.views, small.manifest, every) == 0
    moved = (reads(small, "staged") - staged, reads(small, "tables") - tables)
    assert sum(moved) == SLOTS and moved[0] >= 1
    wait_no_handles(small.sidecar, cluster.pod[0].sidecar)


def test_a_staged_pull_that_fails_gives_its_staging_back(cluster):
    small = cluster.small
    staged_pull(cluster.pod, small, slot(0), slot(1), seed=700)
    ticket = hold(cluster.pod, slot(3), seed=701)
    with cluster.pod[0].sidecar.client() as c:  # the hold goes away: the claim fails
        c.abort(ticket.hold_id)
    with small.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=slot(2), deadline_s=30))
        status = c.wait_pull(accepted.pull_id, timeout_s=60)
    assert status.state == "failed", status
    # Its lease came back: the next pull fits the one-pull buffer again and is staged.
    staged = reads(small, "staged")
    pull(cluster.pod, small, slot(0), slot(1), seed=702)
    wait_until(lambda: reads(small, "staged") == staged + 1, what="the next pull staged")
    wait_no_handles(small.sidecar, cluster.pod[0].sidecar)
