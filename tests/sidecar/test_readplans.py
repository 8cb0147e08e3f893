"""A pull's READ tables for every prefill rank: planned together where the ranks read the same
ids, rank by rank otherwise, and the same bytes either way; from a pod sidecar, one READ holding
every rank's tables. Pure planning: no NIXL, no peers reached (transfers of these tables are
covered end to end in test_hetero_tp_e2e.py and test_pod_pull_e2e.py). Each READ names both
sides' memory (DRAM, or VRAM on a GPU) whichever way it was planned."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from kvxferd.descriptors import plan_pull, read_geometry, source_ranks
from kvxferd.errors import HandshakeError
from kvxferd.sidecar.peers import Peer
from kvxferd.sidecar.readplans import ReadPlanner
from kvxferd.wire import PullRequest, Ticket
from tests.descriptors.layouts import hybrid_spec, num_groups, render

SPEC = hybrid_spec()
LOCAL = render(SPEC, 1, 0)
LOCAL_BASES = tuple((i + 1) << 40 for i in range(len(LOCAL.regions)))


def _peer(rank: int) -> Peer:
    manifest = render(SPEC, 2, rank)
    bases = tuple((rank + 3) << 36 | i << 32 for i in range(len(manifest.regions)))
    return Peer(f"10.0.0.{rank}:7600", f"prefill-{rank}", 1, f"agent-{rank}", manifest, bases)


def _ticket(peer: Peer, rank: int, ids: list[list[int]]) -> Ticket:
    return Ticket(engine_id=peer.engine_id, epoch=1, hold_id=f"h{rank}", request_id="r",
                  block_ids=ids, num_tokens=16, expires_at=0.0, tp_rank=rank, tp_size=2,
                  peer=peer.address)  # fmt: skip


def _runner() -> ReadPlanner:
    return ReadPlanner(None)  # type: ignore[arg-type]  # no prepared lists: no transport used


def _expected(peer: Peer, local_ids, remote_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    plan = plan_pull(read_geometry(LOCAL, peer.manifest), local_ids, remote_ids)
    lb, rb = np.asarray(LOCAL_BASES), np.asarray(peer.region_bases)
    return (lb[plan.local_region] + plan.local_offset,
            rb[plan.remote_region] + plan.remote_offset, plan.length)  # fmt: skip


def _tables(read) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    (la, ll), (ra, rl) = read.tables
    np.testing.assert_array_equal(ll, rl)
    return la, ra, ll


def _plan(runner: ReadPlanner, remote_ids: list[list[list[int]]]):
    assert source_ranks(LOCAL, 2) == [0, 1]
    peers = [_peer(r) for r in range(2)]
    tickets = [_ticket(p, r, remote_ids[r]) for r, p in enumerate(peers)]
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    req = PullRequest(tickets=tickets, block_ids=local_ids)
    reads = runner.ranks(req, peers, tickets, LOCAL, LOCAL_BASES)
    for read, peer, ids in zip(reads, peers, remote_ids, strict=True):
        assert read.num_descriptors > 0
        for got, want in zip(_tables(read), _expected(peer, local_ids, ids), strict=True):
            np.testing.assert_array_equal(got, want)
    return reads


def test_ranks_reading_the_same_ids_are_planned_together_as_each_alone():
    runner = _runner()
    ids = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    _plan(runner, [ids, ids])
    _plan(runner, [ids, ids])
    assert len(runner._fan_ins) == 1  # the stacked geometry is built once per set of peers


def test_ranks_reading_different_ids_are_planned_one_by_one():
    runner = _runner()
    a = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    b = [[g * 4, g * 4 + 3] for g in range(num_groups(SPEC))]
    _plan(runner, [a, b])
    assert not runner._fan_ins


def _in_vram(manifest, device: int):  # noqa: ANN001
    regions = [msgspec.structs.replace(r, mem="VRAM", device_id=device) for r in manifest.regions]
    return msgspec.structs.replace(manifest, regions=regions)


def test_every_ranks_read_names_each_sides_memory_planned_together_or_alone():
    """vLLM's KV lives in VRAM: whichever way a pull is planned, each rank's READ names our
    memory and that rank's, or NIXL finds no registration covering it."""
    local = _in_vram(LOCAL, 1)
    runner = _runner()
    peers = [dataclasses.replace(p, manifest=_in_vram(p.manifest, 3)) for p in
             (_peer(0), _peer(1))]  # fmt: skip
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    a = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    b = [[g * 4, g * 4 + 3] for g in range(num_groups(SPEC))]
    for remote_ids in ([a, a], [a, b]):  # stacked (fan-in), then rank by rank
        tickets = [_ticket(p, r, remote_ids[r]) for r, p in enumerate(peers)]
        req = PullRequest(tickets=tickets, block_ids=local_ids)
        reads = runner.ranks(req, peers, tickets, local, LOCAL_BASES)
        assert [r.memory for r in reads] == [(("VRAM", 1), ("VRAM", 3))] * 2
    assert len(runner._fan_ins) == 1  # the first went stacked


def _pod(ranks: int = 2) -> Peer:
    """A pod sidecar serving ranks 0..ranks-1 of the spec: one agent, every rank's bases."""
    views = [_peer(r) for r in range(ranks)]
    views = [dataclasses.replace(v, address=views[0].address, engine_id="pod", agent_name="pod")
             for v in views]  # fmt: skip
    return dataclasses.replace(views[0], pod=tuple(views[1:]))


def _pod_ticket(ids: list[list[int]], ranks: int = 2) -> Ticket:
    return Ticket(engine_id="pod", epoch=1, hold_id="h", request_id="r", block_ids=ids,
                  num_tokens=16, expires_at=0.0, tp_rank=0, tp_size=ranks, ranks=ranks,
                  peer="10.0.0.0:7600")  # fmt: skip


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "rank-by-rank"])
def test_a_pods_ranks_are_read_in_one_read_of_every_ranks_tables(stacked):
    """One READ from a pod moves what a READ from each rank's own sidecar would: each rank's
    rows at that rank's region bases (the geometry is cached per rank, not per peer)."""
    runner = _runner()
    pod = _pod()
    ids = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    req = PullRequest(tickets=[_pod_ticket(ids)], block_ids=local_ids)
    runner.views.enabled = True  # prepared lists are never used for a pod
    if not stacked:  # as where the ranks' geometries cannot be stacked (a peer that re-blocks)
        runner._fan_in = lambda geometries: None  # type: ignore[method-assign]
    read = runner.pod(req, pod, [0, 1], LOCAL, LOCAL_BASES)
    want = [_expected(pod.rank(r), local_ids, ids) for r in (0, 1)]
    for got, parts in zip(_tables(read), zip(*want, strict=True), strict=True):
        np.testing.assert_array_equal(got, np.concatenate(parts))
    assert read.prepped is None and read.memory == (("DRAM", 0), ("DRAM", 0))
    alone = [_plan_one(pod.rank(r), ids, local_ids) for r in (0, 1)]
    assert read.num_descriptors == sum(a.num_descriptors for a in alone)
    assert (read.kv_bytes, read.state_bytes) == (sum(a.kv_bytes for a in alone),
                                                 sum(a.state_bytes for a in alone))  # fmt: skip


def _plan_one(peer: Peer, ids, local_ids):  # noqa: ANN001
    return plan_pull(read_geometry(LOCAL, peer.manifest), local_ids, ids)


def test_a_pod_read_covers_only_the_ranks_this_rank_reads_from():
    runner = _runner()
    pod = _pod()
    ids = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    req = PullRequest(tickets=[_pod_ticket(ids)], block_ids=local_ids)
    read = runner.pod(req, pod, [1], LOCAL, LOCAL_BASES)
    for got, want in zip(_tables(read), _expected(pod.rank(1), local_ids, ids), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_pod_that_serves_other_ranks_than_the_ticket_spans_fails_the_pull():
    runner = _runner()
    ids = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    req = PullRequest(tickets=[_pod_ticket(ids)], block_ids=local_ids)
    with pytest.raises(HandshakeError, match="serves 1 ranks, the ticket spans 2"):
        runner.pod(req, _peer(0), [0, 1], LOCAL, LOCAL_BASES)
