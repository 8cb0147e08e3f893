"""A pod sidecar (``serve --pod-ranks N``) serves every TP rank of a prefill engine: a decode
pulls from it with one ticket, one claim and one READ, byte-exact, over real NIXL.

One ``kvxferd serve`` process serves the pod: each of its N ranks registers its own pool on the
shared engine socket and places every hold under the same id. The decode sidecars (TP 1, and
both ranks of TP 2) read each rank's TP slice from the one agent, as they would from N rank
sidecars: every byte of every layer of every block they read is checked, and nothing outside
those blocks changed. The models: a Mamba2 hybrid at TP 2 and 4, a GDN hybrid at TP 2 (the
planner gives these the same block sizes at TP 1, 2 and 4, so the same ids address the same
tokens), and a llama cut to one KV head, replicated at TP 2 (decode TP 1 reads rank 0 alone).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from kvxferd import descriptors
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, Manifest, PullRequest, Ticket
from tests.sidecar.harness import (
    ONE_KV_HEAD,
    QUIET,
    EnginePool,
    EngineRank,
    ReleasedFeed,
    changed_outside,
    metric,
    plan,
    split_ids,
    start_sidecars,
    wait_no_handles,
)

pytestmark = pytest.mark.nixl

Rank = EngineRank


def _plan(config: str, tp_size: int, tp_rank: int, num_blocks: int) -> Manifest:
    return plan(config, tp_size=tp_size, tp_rank=tp_rank, num_blocks=num_blocks)


@dataclass
class Cluster:
    """A prefill pod of ``len(pod)`` ranks and decode engines of TP 1 and 2, all registered."""

    pod: list[Rank]
    one: Rank
    two: list[Rank]
    counts: list[int]
    num_blocks: int


@pytest.fixture(
    scope="module",
    params=[
        ("granite-4.0-h-tiny", 2),
        ("granite-4.0-h-tiny", 4),
        ("qwen3-next-80b-a3b", 2),
        (ONE_KV_HEAD, 2),
    ],
    ids=["mamba2-hybrid-pod2", "mamba2-hybrid-pod4", "gdn-hybrid-pod2", "replicated-kv-head-pod2"],
)
def cluster(request, tmp_path_factory):
    config, size = request.param
    probe = _plan(config, 1, 0, 4)
    counts = [1 if g.kind == "mamba" else 3 for g in probe.groups]
    num_blocks = 2 * sum(counts) + 1  # room to fragment; block 0 stays unused
    pod = [_plan(config, size, r, num_blocks) for r in range(size)]
    decode = [_plan(config, 1, 0, num_blocks)] + [_plan(config, 2, r, num_blocks) for r in range(2)]
    assert len({tuple(g.block_size for g in m.groups) for m in pod + decode}) == 1
    tmp = str(tmp_path_factory.mktemp(f"pod-{config}-{size}"))
    pod_sidecar = start_sidecars(tmp, ["pod"], "--pod-ranks", str(size), env=QUIET)[0]
    others = start_sidecars(tmp, ["tp1-r0", "tp2-r0", "tp2-r1"], env=QUIET)
    sidecars = [pod_sidecar, *others]
    pools = [EnginePool(m) for m in pod + decode]
    try:
        ranks = [Rank(s, m, p) for s, m, p in
                 zip([pod_sidecar] * size + others, pod + decode, pools, strict=True)]  # fmt: skip
        with ThreadPoolExecutor(size) as workers:  # a pod rank's register waits for the rest
            generations = set(workers.map(_register, ranks[:size]))
        assert len(generations) == 1  # one registration generation for the whole pod
        for rank in ranks[size:]:
            _register(rank)
        yield Cluster(ranks[:size], ranks[size], ranks[size + 1 :], counts, num_blocks)
    finally:
        codes = [s.stop() for s in sidecars]
        for pool in pools:
            pool.close()
    assert codes == [0] * len(sidecars)


def _register(rank: Rank) -> int:
    with rank.sidecar.client() as c:
        return c.register(rank.manifest, rank.pool.specs()).generation


def _ids(cluster: Cluster, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return split_ids(rng.permutation(np.arange(1, cluster.num_blocks)), cluster.counts)


def _hold(cluster: Cluster, ids: list[list[int]], seed: int) -> Ticket:
    """Every pod rank writes its slice of the request and places the hold under one id; each
    gets the same ticket, for the whole pod."""
    hold_id = f"h-{uuid.uuid4().hex[:8]}"
    tickets = []
    for r, rank in enumerate(cluster.pod):
        write_pattern(rank.manifest, rank.pool.views, ids, seed=seed)
        with rank.sidecar.client() as c:
            req = HoldRequest(request_id=hold_id, block_ids=ids, num_tokens=64, hold_id=hold_id,
                              tp_rank=r)  # fmt: skip
            tickets.append(c.hold(req))
    assert all(t == tickets[0] for t in tickets)
    size = len(cluster.pod)
    assert (tickets[0].tp_rank, tickets[0].tp_size, tickets[0].ranks) == (0, size, size)
    return tickets[0]


def _pull_and_verify(rank: Rank, ticket: Ticket, ids: list[list[int]], seed: int):
    before = rank.pool.snapshot()
    with rank.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=ids, deadline_s=60))
        status = c.wait_pull(accepted.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(rank.manifest, rank.pool.views, ids, seed=seed) is None
    assert changed_outside(before, rank.pool.views, rank.manifest, ids) == 0
    return status


def _reads(rank: Rank) -> float:
    return sum(metric(rank.sidecar.peer, "kvxferd_reads_total", path=p)
               for p in ("tables", "prepped", "staged"))  # fmt: skip


def _claims(rank: Rank) -> float:
    return sum(metric(rank.sidecar.peer, "kvxferd_peer_calls_total", call="claim", wire=w)
               for w in ("frames", "http"))  # fmt: skip


def test_a_decode_reads_every_rank_of_a_pod_in_one_claim_and_one_read(cluster):
    pids, dids = _ids(cluster, 1), _ids(cluster, 2)
    ticket = _hold(cluster, pids, seed=11)
    claims, reads = _claims(cluster.one), _reads(cluster.one)
    status = _pull_and_verify(cluster.one, ticket, dids, seed=11)
    # The bytes of a read from each rank's own sidecar: every source rank's slice.
    own = [np.asarray(g, dtype=np.int64) for g in dids]
    sources = descriptors.source_ranks(cluster.one.manifest, len(cluster.pod))
    want = sum(descriptors.plan_read(cluster.one.manifest, cluster.pod[r].manifest, own,
                                     [np.asarray(g, dtype=np.int64) for g in pids]).total_bytes
               for r in sources)  # fmt: skip
    assert status.kv_bytes + status.state_bytes == want
    assert (_claims(cluster.one) - claims, _reads(cluster.one) - reads) == (1, 1)
    feed = ReleasedFeed(cluster.pod[0].sidecar)
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
    assert feed.count(ticket.hold_id) == 1
    wait_no_handles(cluster.one.sidecar, cluster.pod[0].sidecar)


def test_a_pod_hold_is_released_once_every_decode_rank_read_it(cluster):
    pids, dids = _ids(cluster, 3), _ids(cluster, 4)
    ticket = _hold(cluster, pids, seed=33)
    # One decode rank after the other: the second claim succeeds only because the first
    # rank's notification did not release the hold (it waits for both readers).
    for rank in cluster.two:
        _pull_and_verify(rank, ticket, dids, seed=33)
    feed = ReleasedFeed(cluster.pod[0].sidecar)
    assert feed.wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
    assert feed.count(ticket.hold_id) == 1
    wait_no_handles(cluster.pod[0].sidecar, *(r.sidecar for r in cluster.two))


def test_a_pull_with_one_ranks_ticket_of_a_pod_is_refused_before_it_reads(cluster):
    pids, dids = _ids(cluster, 5), _ids(cluster, 6)
    ticket = _hold(cluster, pids, seed=55)
    from kvxferd.errors import BlockIdError

    with cluster.one.sidecar.client() as c:
        bad = PullRequest(tickets=[ticket, ticket], block_ids=dids, deadline_s=10)
        with pytest.raises(BlockIdError) as exc:
            c.pull(bad)
    assert exc.value.field == "tickets[0].ranks"
