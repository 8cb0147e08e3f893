"""The rig of the staged-READ tests: a pod sidecar serving prefill TP 8 of the bench's hybrid
(``SMALL_HYBRID``: 8 KV heads, 6 Mamba2 layers), decode TP 1 ranks reading from it, and the
verified pull they make (every byte of every layer of every block read, nothing else written,
the hold notified)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvxferd import descriptors
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sim.sidecars import SidecarProcess
from kvxferd.wire import HoldRequest, Manifest, PullRequest, PullStatus, Ticket
from tests.sidecar.harness import (
    SMALL_HYBRID,
    EnginePool,
    EngineRank,
    ReleasedFeed,
    changed_outside,
    metric,
)

TP = 8
SLOT = [1, 1, 1, 13]  # blocks per group of one pull (3 Mamba groups, 1 attention group)
SLOTS = 4
NUM_BLOCKS = 1 + SLOTS * sum(SLOT)
ONE_PULL = 16 * (32 << 10)  # a staging buffer of one pull: its 16 runs of 32 KiB, no more


def plan(tp_size: int, tp_rank: int) -> Manifest:
    opts = PlanOptions(tp_size=tp_size, tp_rank=tp_rank, num_blocks=NUM_BLOCKS,
                       engine_id=f"t{uuid.uuid4().hex[:8]}")  # fmt: skip
    return plan_manifest({**load_hf_config("granite-4.0-h-tiny"), **SMALL_HYBRID}, opts)


def register(rank: EngineRank) -> None:
    with rank.sidecar.client() as c:
        c.register(rank.manifest, rank.pool.specs())


def ranks(
    pod: SidecarProcess, decodes: Sequence[SidecarProcess], pools: list[EnginePool]
) -> tuple[list[EngineRank], list[EngineRank]]:
    """The pod's TP ranks and one TP 1 rank per decode sidecar, registered; their pools are
    appended to ``pools`` (the caller closes them)."""
    manifests = [plan(TP, r) for r in range(TP)] + [plan(1, 0) for _ in decodes]
    pools += [EnginePool(m) for m in manifests]
    sidecars = [pod] * TP + list(decodes)
    out = [EngineRank(s, m, p) for s, m, p in
           zip(sidecars, manifests, pools[-len(manifests):], strict=True)]  # fmt: skip
    with ThreadPoolExecutor(TP) as workers:  # a pod rank's register waits for the rest
        list(workers.map(register, out[:TP]))
    for rank in out[TP:]:
        register(rank)
    return out[:TP], out[TP:]


def slot(s: int) -> list[list[int]]:
    """Slot ``s``'s block ids per group (block 0 stays unused)."""
    out, start = [], 1 + s * sum(SLOT)
    for n in SLOT:
        out.append(list(range(start, start + n)))
        start += n
    return out


def hold(pod: Sequence[EngineRank], ids: list[list[int]], seed: int,
         lease_s: float = 30.0) -> Ticket:  # fmt: skip
    """``ids`` written with the pattern of ``seed`` and held on every pod rank: the ticket."""
    hold_id = f"h-{uuid.uuid4().hex[:8]}"
    tickets = []
    for r, rank in enumerate(pod):
        write_pattern(rank.manifest, rank.pool.views, ids, seed=seed)
        with rank.sidecar.client() as c:
            tickets.append(c.hold(HoldRequest(request_id=hold_id, block_ids=ids, num_tokens=416,
                                              hold_id=hold_id, tp_rank=r,
                                              lease_s=lease_s)))  # fmt: skip
    assert all(t == tickets[0] for t in tickets)
    return tickets[0]


def reads(rank: EngineRank, path: str) -> float:
    """READs ``rank``'s sidecar did by ``path`` (staged, tables, prepped)."""
    return metric(rank.sidecar.peer, "kvxferd_reads_total", path=path)


def read_failures(rank: EngineRank, path: str) -> float:
    """READs of ``rank``'s sidecar by ``path`` that failed."""
    return metric(rank.sidecar.peer, "kvxferd_read_failures_total", path=path)


def want_bytes(decode: EngineRank, pod: Sequence[EngineRank], ids, pids) -> int:
    own = [np.asarray(g, dtype=np.int64) for g in ids]
    theirs = [np.asarray(g, dtype=np.int64) for g in pids]
    return sum(descriptors.plan_read(decode.manifest, pod[r].manifest, own, theirs)
               .total_bytes for r in descriptors.source_ranks(decode.manifest, TP))  # fmt: skip


def pull(pod: Sequence[EngineRank], decode: EngineRank, ids, pids, seed: int) -> PullStatus:
    """One pull of ``pids`` on the pod into ``ids`` on ``decode``: DONE, every byte in place,
    nothing else written, the bytes planned moved, the hold notified."""
    ticket = hold(pod, pids, seed)
    before = decode.pool.snapshot()
    with decode.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=ids, deadline_s=60))
        status = c.wait_pull(accepted.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(decode.manifest, decode.pool.views, ids, seed=seed) is None
    assert changed_outside(before, decode.pool.views, decode.manifest, ids) == 0
    assert status.kv_bytes + status.state_bytes == want_bytes(decode, pod, ids, pids)
    feed = ReleasedFeed(pod[0].sidecar)
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
    return status


def staged_pull(pod: Sequence[EngineRank], decode: EngineRank, ids, pids, seed: int) -> PullStatus:
    """Pulls until one is staged (the buffer registers on the first pull that wants it, which
    reads direct meanwhile); every pull verified. Bounded."""
    for attempt in range(20):
        staged = reads(decode, "staged")
        status = pull(pod, decode, ids, pids, seed + attempt)
        if reads(decode, "staged") == staged + 1:
            return status
    raise AssertionError("no pull was staged in 20")
