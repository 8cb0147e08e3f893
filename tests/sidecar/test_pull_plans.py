"""A pull's READ tables for every prefill rank: planned together where the ranks read the same
ids, rank by rank otherwise, and the same bytes either way. Pure planning: no NIXL, no peers
reached (a transfer of these tables is covered end to end in test_hetero_tp_e2e.py). Each READ
names both sides' memory (DRAM, or VRAM on a GPU) whichever way it was planned."""

from __future__ import annotations

import dataclasses
import types

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry

from kvxferd.descriptors import plan_pull, read_geometry, source_ranks
from kvxferd.metrics import Metrics
from kvxferd.sidecar.peers import Peer
from kvxferd.sidecar.pulls import Pull, PullRunner
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


def _runner() -> PullRunner:
    return PullRunner(
        local=lambda: (LOCAL, LOCAL_BASES),
        transport=types.SimpleNamespace(name="decode"),  # type: ignore[arg-type]
        peers=types.SimpleNamespace(forget=None),  # type: ignore[arg-type]
        metrics=Metrics(registry=CollectorRegistry()),
    )


def _expected(peer: Peer, local_ids, remote_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    plan = plan_pull(read_geometry(LOCAL, peer.manifest), local_ids, remote_ids)
    lb, rb = np.asarray(LOCAL_BASES), np.asarray(peer.region_bases)
    return (lb[plan.local_region] + plan.local_offset,
            rb[plan.remote_region] + plan.remote_offset, plan.length)  # fmt: skip


def _tables(read) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    (la, ll), (ra, rl) = read.tables
    np.testing.assert_array_equal(ll, rl)
    return la, ra, ll


def _plan(runner: PullRunner, remote_ids: list[list[list[int]]]):
    assert source_ranks(LOCAL, 2) == [0, 1]
    peers = [_peer(r) for r in range(2)]
    tickets = [_ticket(p, r, remote_ids[r]) for r, p in enumerate(peers)]
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    pull = Pull("p", PullRequest(tickets=tickets, block_ids=local_ids))
    reads = runner._plan(pull, peers, tickets, LOCAL, LOCAL_BASES)
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
    runner = PullRunner(
        local=lambda: (local, LOCAL_BASES),
        transport=types.SimpleNamespace(name="decode"),  # type: ignore[arg-type]
        peers=types.SimpleNamespace(forget=None),  # type: ignore[arg-type]
        metrics=Metrics(registry=CollectorRegistry()),
    )
    peers = [dataclasses.replace(p, manifest=_in_vram(p.manifest, 3)) for p in
             (_peer(0), _peer(1))]  # fmt: skip
    local_ids = [[g * 4 + 1, g * 4 + 2] for g in range(num_groups(SPEC))]
    a = [[g * 4 + 3, g * 4] for g in range(num_groups(SPEC))]
    b = [[g * 4, g * 4 + 3] for g in range(num_groups(SPEC))]
    for remote_ids in ([a, a], [a, b]):  # stacked (fan-in), then rank by rank
        tickets = [_ticket(p, r, remote_ids[r]) for r, p in enumerate(peers)]
        pull = Pull("p", PullRequest(tickets=tickets, block_ids=local_ids))
        reads = runner._plan(pull, peers, tickets, local, LOCAL_BASES)
        assert [r.memory for r in reads] == [(("VRAM", 1), ("VRAM", 3))] * 2
    assert len(runner._fan_ins) == 1  # the first went stacked
