"""A decode pulling from eight prefill ranks stages its READ: each rank's blocks are read whole
into the staging buffer and scattered into place, byte-exact, over real NIXL.

One pod sidecar (``serve --pod-ranks 8``) serves prefill TP 8 of scripts/bench_pulls.py's
hybrid (8 KV heads, 6 Mamba2 layers); decode TP 1 sidecars read from it: two with the default
staging buffer, one with staging off (``--staging-bytes 0``), one whose buffer holds one pull.
Every byte of every layer of every block read is checked, and nothing outside those blocks
(padding, other blocks) changed.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from kvxferd import descriptors
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, Manifest, PullRequest, PullStatus, Ticket
from tests.sidecar.harness import (
    QUIET,
    SMALL_HYBRID,
    EnginePool,
    EngineRank,
    ReleasedFeed,
    changed_outside,
    metric,
    start_sidecars,
    wait_no_handles,
    wait_until,
)

pytestmark = pytest.mark.nixl

TP = 8
SLOT = [1, 1, 1, 13]  # blocks per group of one pull (3 Mamba groups, 1 attention group)
SLOTS = 4
NUM_BLOCKS = 1 + SLOTS * sum(SLOT)
ONE_PULL = 16 * (32 << 10)  # a staging buffer of one pull: its 16 runs of 32 KiB, no more


def _plan(tp_size: int, tp_rank: int) -> Manifest:
    opts = PlanOptions(tp_size=tp_size, tp_rank=tp_rank, num_blocks=NUM_BLOCKS,
                       engine_id=f"t{uuid.uuid4().hex[:8]}")  # fmt: skip
    return plan_manifest({**load_hf_config("granite-4.0-h-tiny"), **SMALL_HYBRID}, opts)


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
        manifests = [_plan(TP, r) for r in range(TP)] + [_plan(1, 0) for _ in range(4)]
        pools = [EnginePool(m) for m in manifests]
        ranks = [EngineRank(s, m, p) for s, m, p in
                 zip([pod_sidecar] * TP + sidecars[1:], manifests, pools, strict=True)]  # fmt: skip
        with ThreadPoolExecutor(TP) as workers:  # a pod rank's register waits for the rest
            list(workers.map(_register, ranks[:TP]))
        for rank in ranks[TP:]:
            _register(rank)
        yield Cluster(ranks[:TP], *ranks[TP:])
    finally:
        codes = [s.stop() for s in sidecars]
        for pool in pools:
            pool.close()
    assert codes == [0] * len(sidecars)


def _register(rank: EngineRank) -> None:
    with rank.sidecar.client() as c:
        c.register(rank.manifest, rank.pool.specs())


def _slot(s: int) -> list[list[int]]:
    out, start = [], 1 + s * sum(SLOT)
    for n in SLOT:
        out.append(list(range(start, start + n)))
        start += n
    return out


def _fragmented(seed: int) -> list[list[int]]:
    """A pull's decode ids scattered over the whole pool (never in block order)."""
    ids = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))[: sum(SLOT)]
    return [ids[a:b].tolist() for a, b in zip(np.cumsum([0, *SLOT[:-1]]), np.cumsum(SLOT),
                                              strict=True)]  # fmt: skip


def _hold(cluster: Cluster, ids: list[list[int]], seed: int) -> Ticket:
    hold_id = f"h-{uuid.uuid4().hex[:8]}"
    tickets = []
    for r, rank in enumerate(cluster.pod):
        write_pattern(rank.manifest, rank.pool.views, ids, seed=seed)
        with rank.sidecar.client() as c:
            tickets.append(c.hold(HoldRequest(request_id=hold_id, block_ids=ids, num_tokens=416,
                                              hold_id=hold_id, tp_rank=r)))  # fmt: skip
    assert all(t == tickets[0] for t in tickets)
    return tickets[0]


def _want_bytes(decode: EngineRank, cluster: Cluster, ids, pids) -> int:
    own = [np.asarray(g, dtype=np.int64) for g in ids]
    theirs = [np.asarray(g, dtype=np.int64) for g in pids]
    return sum(descriptors.plan_read(decode.manifest, cluster.pod[r].manifest, own, theirs)
               .total_bytes for r in descriptors.source_ranks(decode.manifest, TP))  # fmt: skip


def _reads(rank: EngineRank, path: str) -> float:
    return metric(rank.sidecar.peer, "kvxferd_reads_total", path=path)


def _pull(cluster: Cluster, decode: EngineRank, ids, pids, seed: int) -> PullStatus:
    """One verified pull of ``pids`` on the pod into ``ids`` on ``decode``."""
    ticket = _hold(cluster, pids, seed)
    before = decode.pool.snapshot()
    with decode.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=ids, deadline_s=60))
        status = c.wait_pull(accepted.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(decode.manifest, decode.pool.views, ids, seed=seed) is None
    assert changed_outside(before, decode.pool.views, decode.manifest, ids) == 0
    assert status.kv_bytes + status.state_bytes == _want_bytes(decode, cluster, ids, pids)
    feed = ReleasedFeed(cluster.pod[0].sidecar)
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
    return status


def _staged_pull(cluster: Cluster, decode: EngineRank, ids, pids, seed: int) -> PullStatus:
    """Pulls until one is staged (the buffer registers on the first pull that wants it, which
    reads direct meanwhile); every pull verified. Bounded."""
    for attempt in range(20):
        staged = _reads(decode, "staged")
        status = _pull(cluster, decode, ids, pids, seed + attempt)
        if _reads(decode, "staged") == staged + 1:
            return status
    raise AssertionError("no pull was staged in 20")


def test_a_pull_from_eight_pod_ranks_is_staged_and_every_byte_lands_in_place(cluster):
    status = _staged_pull(cluster, cluster.staged, _slot(0), _slot(1), seed=100)
    assert status.descriptors == TP * 2  # one run per rank and region, not 304 rows
    wait_no_handles(cluster.staged.sidecar, cluster.pod[0].sidecar)


def test_the_first_pull_reads_direct_while_the_staging_buffer_registers(cluster):
    fresh = cluster.fresh
    status = _pull(cluster, fresh, _slot(0), _slot(1), seed=150)  # its tables built on demand
    assert status.descriptors == 304
    assert (_reads(fresh, "tables"), _reads(fresh, "staged")) == (1, 0)
    status = _staged_pull(cluster, fresh, _slot(2), _slot(3), seed=160)
    assert status.descriptors == TP * 2


def test_a_staged_pull_scatters_into_fragmented_decode_blocks(cluster):
    _staged_pull(cluster, cluster.staged, _slot(0), _slot(1), seed=200)  # registered
    for seed in (7, 8, 9):
        staged = _reads(cluster.staged, "staged")
        _pull(cluster, cluster.staged, _fragmented(seed), _slot(2), seed=300 + seed)
        assert _reads(cluster.staged, "staged") == staged + 1


def test_with_staging_off_the_same_pull_reads_direct(cluster):
    tables = _reads(cluster.direct, "tables")
    status = _pull(cluster, cluster.direct, _slot(0), _slot(1), seed=400)
    assert status.descriptors == 304
    assert _reads(cluster.direct, "tables") == tables + 1
    assert _reads(cluster.direct, "staged") == 0


def test_pulls_that_find_the_staging_buffer_full_read_direct(cluster):
    small = cluster.small
    _staged_pull(cluster, small, _slot(0), _slot(1), seed=500)  # the buffer is registered
    staged, tables = _reads(small, "staged"), _reads(small, "tables")
    holds = [(_slot(s), _slot((s + 1) % SLOTS), 600 + s) for s in range(SLOTS)]
    tickets = [_hold(cluster, pids, seed) for _, pids, seed in holds]
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
    moved = (_reads(small, "staged") - staged, _reads(small, "tables") - tables)
    assert sum(moved) == SLOTS and moved[0] >= 1
    wait_no_handles(small.sidecar, cluster.pod[0].sidecar)


def test_a_staged_pull_that_fails_gives_its_staging_back(cluster):
    small = cluster.small
    _staged_pull(cluster, small, _slot(0), _slot(1), seed=700)
    ticket = _hold(cluster, _slot(3), seed=701)
    with cluster.pod[0].sidecar.client() as c:  # the hold goes away: the claim fails
        c.abort(ticket.hold_id)
    with small.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=_slot(2), deadline_s=30))
        status = c.wait_pull(accepted.pull_id, timeout_s=60)
    assert status.state == "failed", status
    # Its lease came back: the next pull fits the one-pull buffer again and is staged.
    staged = _reads(small, "staged")
    _pull(cluster, small, _slot(0), _slot(1), seed=702)
    wait_until(lambda: _reads(small, "staged") == staged + 1, what="the next pull staged")
    wait_no_handles(small.sidecar, cluster.pod[0].sidecar)
