"""A pull that reports FAILED can no longer write: cancelled at any point, its READs settle first.

Large pulls (1,500 blocks, ~590 MB) between real sidecars over NIXL loopback, ended at random
points: tiny deadlines (every phase: handshake, claim, mid-post, mid-wait), explicit task
cancellation, and a prefill frozen by SIGSTOP mid-transfer. Each time the decode's blocks are
snapshotted the moment FAILED is observed; after the prefill's hold is released or expired and
both sides are quiet (0 live NIXL handles), not one byte may have changed since.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from kvxferd.config import Config
from kvxferd.errors import CallExpiredError
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.service import Sidecar as InProcessSidecar
from kvxferd.sidecar.states import PullState
from kvxferd.wire import HoldRequest, PullRequest, RegisterRequest, Ticket
from tests.sidecar.harness import (
    QUIET,
    SENTINEL,
    TOKEN,
    EnginePool,
    ReleasedFeed,
    metric,
    plan,
    split_ids,
    start_sidecars,
    wait_no_handles,
    wait_until,
)

pytestmark = pytest.mark.nixl

MODEL = "gpt-oss-20b"  # two groups (sliding window + full attention), ~390 KB a block
BLOCKS = 1500
_UNDER_WAY = ("transferring", "done", "failed")
_READING = ("claiming", *_UNDER_WAY)  # the READ goes out while the claim is in flight
LEASE_S = 3.0  # an unclaimed hold of a round that failed early expires by then


class Cluster:
    """A registered prefill and decode sidecar, the prefill's pattern written once."""

    def __init__(self, tmp: str) -> None:
        self.p, self.d = start_sidecars(tmp, ["prefill", "decode"], env=QUIET)
        self.pm = plan(MODEL, num_blocks=BLOCKS + 1)
        self.dm = plan(MODEL, num_blocks=BLOCKS + 1)
        self.ppool, self.dpool = EnginePool(self.pm), EnginePool(self.dm)
        counts = [BLOCKS // len(self.pm.groups)] * len(self.pm.groups)
        rng = np.random.default_rng(3)
        self.pids = split_ids(rng.permutation(np.arange(1, BLOCKS + 1)), counts)
        self.dids = split_ids(rng.permutation(np.arange(1, BLOCKS + 1)), counts)
        with self.p.client() as pc, self.d.client() as dc:
            pc.register(self.pm, self.ppool.specs())
            dc.register(self.dm, self.dpool.specs())
        write_pattern(self.pm, self.ppool.views, self.pids, seed=21)
        self.feed = ReleasedFeed(self.p)

    def hold(self, request_id: str) -> Ticket:
        with self.p.client() as pc:
            return pc.hold(HoldRequest(request_id=request_id, block_ids=self.pids,
                                       num_tokens=100, lease_s=LEASE_S))  # fmt: skip

    def reset_destination(self) -> None:
        for v in self.dpool.views:
            v[:] = SENTINEL

    def untouched(self, snapshot: list[np.ndarray]) -> bool:
        return all(bool((s == SENTINEL).all()) for s in snapshot)

    def close(self) -> list[int]:
        codes = [self.p.stop(), self.d.stop()]
        self.ppool.close()
        self.dpool.close()
        return codes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("failclosed")))
    try:
        yield c
    finally:
        assert c.close() == [0, 0]


def _quiet_then_unchanged(c: Cluster, ticket: Ticket, snapshot: list[np.ndarray]) -> None:
    """Wait until the hold is gone and no handle is live on either side, then compare."""
    c.feed.wait_for(ticket.hold_id, timeout_s=LEASE_S + 30)
    wait_no_handles(c.p, c.d)
    changed = [int((s != v).sum()) for s, v in zip(snapshot, c.dpool.views, strict=True)]
    assert sum(changed) == 0, f"{sum(changed)} bytes written after FAILED"


def test_tiny_deadlines_at_every_phase_never_write_after_failed(cluster):
    c = cluster
    rng = np.random.default_rng(10)
    # From "fails before the handshake" to "done": some land mid-post and mid-wait.
    deadlines = rng.permutation(np.geomspace(0.001, 2.0, 14))
    outcomes = []
    for i, deadline_s in enumerate(deadlines):
        c.reset_destination()
        ticket = c.hold(f"tiny-{i}")
        with c.d.client() as dc:
            try:
                accepted = dc.pull(PullRequest(tickets=[ticket], block_ids=c.dids,
                                               deadline_s=float(deadline_s)))  # fmt: skip
            except CallExpiredError:  # its deadline, counted from the call, passed on the way
                snapshot = c.dpool.snapshot()
                _quiet_then_unchanged(c, ticket, snapshot)  # its unclaimed hold expires
                assert c.untouched(snapshot)
                outcomes.append("refused")
                continue
            status = dc.wait_pull(accepted.pull_id, timeout_s=60)
        snapshot = c.dpool.snapshot()
        assert status.state in ("done", "failed"), status
        if status.state == "done":
            assert verify_pattern(c.dm, c.dpool.views, c.dids, seed=21) is None
            c.feed.wait_for(ticket.hold_id)
            outcomes.append("done")
            continue
        assert status.reason in ("deadline", "hold_expired"), status
        _quiet_then_unchanged(c, ticket, snapshot)
        outcomes.append("failed-clean" if c.untouched(snapshot) else "failed-after-writing")
    # Both kinds of failure happened: before any byte moved (accepted, or refused on arrival),
    # and with a READ under way.
    assert {"failed-clean", "refused"} & set(outcomes), outcomes
    assert "failed-after-writing" in outcomes, outcomes


@pytest.mark.parametrize(
    "cancel_in",
    [PullState.PENDING, PullState.HANDSHAKING, PullState.CLAIMING, PullState.TRANSFERRING],
    ids=lambda s: s.name.lower(),
)
def test_cancelling_the_pull_task_at_any_point_never_writes_after_failed(
    cluster, cancel_in, monkeypatch
):
    """An in-process decode sidecar (real NIXL agent) whose pull tasks are cancelled."""
    c = cluster
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    rng = np.random.default_rng(int(cancel_in))

    async def main() -> list[str]:
        sc = InProcessSidecar(Config(peer_token=TOKEN, engine_id=f"inproc-{int(cancel_in)}"))
        sc.start()
        outcomes = []
        try:
            await sc.register(RegisterRequest(manifest=c.dm, regions=c.dpool.specs()))
            for i in range(4):
                c.reset_destination()
                ticket = await asyncio.to_thread(c.hold, f"cancel-{int(cancel_in)}-{i}")
                pull = sc.pulls.start(
                    PullRequest(tickets=[ticket], block_ids=c.dids, deadline_s=30)
                )
                async with asyncio.timeout(30):
                    while pull.state < cancel_in and not pull.done.is_set():
                        await asyncio.sleep(0)
                # A random point inside the phase (not a synchronisation: any point must do).
                await asyncio.sleep(float(rng.uniform(0, 0.2)) if i else 0.0)
                sc.pulls.cancel(pull.pull_id)
                async with asyncio.timeout(30):
                    await pull.done.wait()
                snapshot = c.dpool.snapshot()
                if pull.state is PullState.DONE:
                    outcomes.append("done")
                    await asyncio.to_thread(c.feed.wait_for, ticket.hold_id)
                    continue
                assert pull.reason == "cancelled", pull.status()
                assert sc.agent.live_handles().transfers == 0  # settled before FAILED
                await asyncio.to_thread(_quiet_then_unchanged, c, ticket, snapshot)
                outcomes.append("failed-clean" if c.untouched(snapshot) else "failed-written")
        finally:
            await sc.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert any(o.startswith("failed") for o in outcomes), outcomes
    if cancel_in is PullState.TRANSFERRING:  # cancelled mid-post: the post still finished
        assert "failed-written" in outcomes, outcomes


def test_sigstopped_prefill_mid_transfer_fails_without_leaking_a_handle(cluster):
    """Frozen as the pull reaches its claim (its READ goes out at the same time): a claim that
    gets no answer fails the pull by its deadline, and a READ that cannot complete ends it
    ``unsettled`` by the deadline plus the settle bound; the handle stays counted while the READ
    might still write, and is released once the prefill resumes (no leak)."""
    c = cluster
    pid = c.p.child.pid
    for attempt in range(5):  # the READ may complete before the stop lands: try again
        c.reset_destination()
        ticket = c.hold(f"stopped-{attempt}")
        with c.d.client() as dc:
            pull_id = dc.pull(PullRequest(tickets=[ticket], block_ids=c.dids,
                                          deadline_s=3.0)).pull_id  # fmt: skip
            wait_until(lambda p=pull_id: dc.pull_status(p).state in _READING, 30,
                       "pull reading")  # fmt: skip
            os.kill(pid, signal.SIGSTOP)
            try:
                status = dc.wait_pull(pull_id, timeout_s=60)
                snapshot = c.dpool.snapshot()
                frozen_handles = metric(c.d.peer, "kvxferd_nixl_handles")
            finally:
                os.kill(pid, signal.SIGCONT)
        if status.state == "done":
            c.feed.wait_for(ticket.hold_id)
            continue
        assert status.reason in ("deadline", "unsettled"), status
        if status.reason == "unsettled":
            assert frozen_handles >= 1  # kept (quarantined) while it might still write
        _quiet_then_unchanged(c, ticket, snapshot)  # resumed: released, nothing written since
        return
    pytest.skip("every READ completed before SIGSTOP landed")


def test_a_reads_wait_ends_with_its_claim_not_with_a_longer_deadline(tmp_path):
    """A prefill that caps claims at 1 s, frozen mid-READ: the pull (deadline 60 s) fails as
    ``hold_expired`` -- its wait was bounded by the claim -- and leaves no handle. The two read
    over UCX's TCP transport, where the prefill's worker sends every byte of a READ: frozen
    once the claim is answered, it stalls the 590 MB READ midway. (Over CMA the decode copies
    by itself once the prefill progressed once, as the claim arrives, so a freeze after the
    answer usually lands too late.)"""
    short = {**QUIET, "KVXFERD_MAX_LEASE_S": "1", "KVXFERD_DEFAULT_LEASE_S": "1",
             "KVXFERD_MAX_CLAIM_S": "1", "KVXFERD_READ_STRIPES": "1", "UCX_TLS": "tcp"}  # fmt: skip
    p, d = start_sidecars(str(tmp_path), ["short-prefill", "short-decode"], env=short)
    pm, dm = plan(MODEL, num_blocks=BLOCKS + 1), plan(MODEL, num_blocks=BLOCKS + 1)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    ids = split_ids(np.arange(1, BLOCKS + 1), [BLOCKS // len(pm.groups)] * len(pm.groups))
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            for attempt in range(5):  # the READ may complete before the stop lands
                ticket = pc.hold(HoldRequest(request_id=f"short-{attempt}", block_ids=ids,
                                             num_tokens=100))  # fmt: skip
                pull_id = dc.pull(PullRequest(tickets=[ticket], block_ids=ids,
                                              deadline_s=60)).pull_id  # fmt: skip
                wait_until(lambda p=pull_id: dc.pull_status(p).state in _UNDER_WAY, 30,
                           "pull transferring")  # fmt: skip
                os.kill(p.child.pid, signal.SIGSTOP)
                try:
                    status = dc.wait_pull(pull_id, timeout_s=60)
                finally:
                    os.kill(p.child.pid, signal.SIGCONT)
                if status.state == "failed":
                    break
                assert status.state == "done", status
            else:
                pytest.skip("every READ completed before SIGSTOP landed")
            assert status.reason in ("hold_expired", "unsettled"), status
            assert "claim" in status.detail  # the wait ended with the claim, not the deadline
            wait_no_handles(p, d)
    finally:
        codes = [p.stop(), d.stop()]
        ppool.close()
        dpool.close()
    assert codes == [0, 0]
