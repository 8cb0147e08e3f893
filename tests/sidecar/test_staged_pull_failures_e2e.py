"""A staged READ that fails never writes the decode's blocks: neither one that could not be
confirmed stopped (its pages are retired until it ends, for good when it is given up) nor one
that completed past the pull's deadline (nothing is scattered).

One pod sidecar (``serve --pod-ranks 8``) serves prefill TP 8; decode TP 1 sidecars with a
staging buffer of one pull read from it over UCX's TCP transport, where the prefill's worker
sends every byte of a READ: a prefill frozen by SIGSTOP (its peer already cached, so no
handshake is needed) stalls the READ deterministically until it is resumed. Where the order of
two events on the decode's loop decides, the decode runs in-process (a real NIXL agent) and the
test fixes that order. The decode's blocks hold a sentinel; every byte is checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvxferd.config import Config
from kvxferd.pattern import verify_pattern
from kvxferd.sidecar import pulls
from kvxferd.sidecar import reads as reads_mod
from kvxferd.sidecar.service import Sidecar as InProcessSidecar
from kvxferd.sidecar.staging import PAGE
from kvxferd.sidecar.states import PullState
from kvxferd.wire import PullRequest, RegisterRequest
from tests.sidecar.harness import (
    QUIET,
    SENTINEL,
    TOKEN,
    EnginePool,
    EngineRank,
    ReleasedFeed,
    changed_outside,
    metric,
    start_sidecars,
    wait_no_handles,
    wait_until,
)
from tests.sidecar.stagedpod import (
    ONE_PULL,
    TP,
    hold,
    plan,
    pull,
    ranks,
    read_failures,
    reads,
    slot,
    staged_pull,
)

pytestmark = pytest.mark.nixl

TCP = {**QUIET, "UCX_TLS": "tcp"}  # the prefill's worker moves every byte: a freeze stalls it
DEADLINE_S = 1.0


@dataclass
class Cluster:
    pod: list[EngineRank]
    retiring: EngineRank  # a buffer of one pull, retired by an unsettled READ
    late: EngineRank  # a buffer of one pull, whose READ completes past the deadline
    short: EngineRank  # a buffer of half a pull: never staged


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("stagedfail"))
    sidecars = start_sidecars(tmp, ["pod"], "--pod-ranks", str(TP), env=TCP)
    pools: list[EnginePool] = []
    try:
        sidecars += start_sidecars(tmp, ["retiring", "late"], "--staging-bytes", str(ONE_PULL),
                                   env=TCP)  # fmt: skip
        sidecars += start_sidecars(tmp, ["short"], "--staging-bytes", str(ONE_PULL // 2),
                                   env=TCP)  # fmt: skip
        pod, decodes = ranks(sidecars[0], sidecars[1:], pools)
        yield Cluster(pod, *decodes)
    finally:
        codes = [s.stop() for s in sidecars]
        for pool in pools:
            pool.close()
    assert codes == [0] * len(sidecars)


@contextmanager
def _frozen(cluster: Cluster) -> Iterator[None]:
    """The pod sidecar stopped (SIGSTOP) for the block's duration, resumed however it ends."""
    pid = cluster.pod[0].sidecar.child.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _sentinel(decode: EngineRank) -> None:
    for view in decode.pool.views:
        view[:] = SENTINEL


def _untouched(decode: EngineRank) -> int:
    """Bytes of the decode's pool that are no longer the sentinel."""
    return sum(int((v != SENTINEL).sum()) for v in decode.pool.views)


def test_an_unsettled_staged_read_retires_its_pages_only_until_it_ends_never_writing_the_blocks(
    cluster,
):
    """The prefill frozen under a staged READ: the pull ends FAILED ``unsettled`` without one
    byte of the decode's pool written, and the one-pull buffer is retired (reported) while the
    READ may still write it, counted as a failed staged READ. The prefill resumed, the READ
    ends on its own (in the retired pages, scattered nowhere): its pages come back, and the
    next pull is staged, byte-exact."""
    d = cluster.retiring
    staged_pull(cluster.pod, d, slot(0), slot(1), seed=10)
    ticket = hold(cluster.pod, slot(3), seed=11, lease_s=5.0)
    staged, failed = reads(d, "staged"), read_failures(d, "staged")
    _sentinel(d)
    with _frozen(cluster), d.sidecar.client() as c:
        accepted = c.pull(PullRequest(tickets=[ticket], block_ids=slot(2),
                                      deadline_s=DEADLINE_S))  # fmt: skip
        status = c.wait_pull(accepted.pull_id, timeout_s=60)
        assert (status.state, status.reason) == ("failed", "unsettled"), status
        assert _untouched(d) == 0
        assert metric(d.sidecar.peer, "kvxferd_nixl_handles") >= 1  # quarantined
        assert _retired(d) == ONE_PULL // PAGE * PAGE  # the whole buffer: pulls read direct
        assert (reads(d, "staged"), read_failures(d, "staged")) == (staged, failed + 1)
    ReleasedFeed(cluster.pod[0].sidecar).wait_for(ticket.hold_id)  # its claim ended
    wait_no_handles(d.sidecar, cluster.pod[0].sidecar)  # resumed: the READ ended and was released
    assert _untouched(d) == 0  # it landed in the retired pages, scattered nowhere
    wait_until(lambda: _retired(d) == 0, 30, "the ended READ's pages back")
    pull(cluster.pod, d, slot(0), slot(1), seed=20)  # every byte in place, nothing else written
    assert reads(d, "staged") == staged + 1  # staged into the pages the READ held
    assert read_failures(d, "staged") == failed + 1


def _retired(rank: EngineRank) -> float:
    return metric(rank.sidecar.peer, "kvxferd_staging_retired_bytes")


def test_a_staged_read_that_completes_past_the_deadline_scatters_nothing(cluster):
    """The prefill frozen under a staged READ until the pull's deadline has passed, then
    resumed: the READ completes within its settle bound, but past the deadline, so the pull
    ends FAILED ``deadline`` and not one byte of the decode's pool changed: a failed staged
    READ. Its pages come back (it is DONE): the next pull is staged into them, byte-exact."""
    d = cluster.late
    staged_pull(cluster.pod, d, slot(0), slot(1), seed=30)
    ticket = hold(cluster.pod, slot(3), seed=31, lease_s=5.0)
    staged, failed = reads(d, "staged"), read_failures(d, "staged")
    _sentinel(d)
    with d.sidecar.client() as c:
        with _frozen(cluster):
            accepted = c.pull(PullRequest(tickets=[ticket], block_ids=slot(2),
                                          deadline_s=DEADLINE_S))  # fmt: skip
            # The sidecar started the pull before it answered: its deadline is before this.
            past = time.monotonic() + DEADLINE_S
            wait_until(lambda: time.monotonic() > past, 10, "the pull's deadline passed")
            assert c.pull_status(accepted.pull_id).state in ("claiming", "transferring")
        status = c.wait_pull(accepted.pull_id, timeout_s=60)
    assert (status.state, status.reason) == ("failed", "deadline"), status
    ReleasedFeed(cluster.pod[0].sidecar).wait_for(ticket.hold_id)
    wait_no_handles(d.sidecar, cluster.pod[0].sidecar)
    assert _untouched(d) == 0
    assert metric(d.sidecar.peer, "kvxferd_staging_retired_bytes") == 0
    assert read_failures(d, "staged") == failed + 1
    pull(cluster.pod, d, slot(0), slot(1), seed=32)
    assert (reads(d, "staged"), read_failures(d, "staged")) == (staged + 1, failed + 1)


def test_a_staging_buffer_smaller_than_one_read_leaves_every_pull_direct(cluster):
    d = cluster.short
    for s in range(2):  # the first would register a buffer if the READ could ever fit it
        status = pull(cluster.pod, d, slot(s), slot(s + 1), seed=60 + s)
        assert status.descriptors == 304
    assert (reads(d, "staged"), reads(d, "tables")) == (0, 2)
    assert read_failures(d, "tables") == read_failures(d, "staged") == 0


class InProcess:
    """A decode sidecar in this process (real NIXL agent over TCP, a one-pull staging buffer)
    and its engine's pool, its own pattern and sentinel helpers."""

    def __init__(self, cluster: Cluster, sidecar: InProcessSidecar) -> None:
        self.cluster = cluster
        self.sc = sidecar
        self.manifest = plan(1, 0)
        self.pool = EnginePool(self.manifest)

    async def pull(self, ids, pids, seed: int, deadline_s: float = 60.0, *,
                   frozen: bool = False) -> pulls.Pull:  # fmt: skip
        """One pull of ``pids`` into ``ids``, ended; ``frozen``: the pod stopped meanwhile."""
        ticket = await asyncio.to_thread(hold, self.cluster.pod, pids, seed, 5.0)
        with _frozen(self.cluster) if frozen else contextlib.nullcontext():
            pull = self.sc.pulls.start(PullRequest(tickets=[ticket], block_ids=ids,
                                                   deadline_s=deadline_s))  # fmt: skip
            async with asyncio.timeout(60):
                await pull.done.wait()
        return pull

    async def staged(self, ids, pids, seed: int) -> None:
        """Pulls until one is staged (the peer cached, the buffer registered), each verified."""
        for attempt in range(20):
            staged = self.sc.pulls.staging.staged
            pull = await self.pull(ids, pids, seed + attempt)
            assert pull.state is PullState.DONE, pull.status()
            assert verify_pattern(self.manifest, self.pool.views, ids, seed=seed + attempt) is None
            if self.sc.pulls.staging.staged == staged + 1:
                return
        raise AssertionError("no pull was staged in 20")

    def untouched(self) -> int:
        return sum(int((v != SENTINEL).sum()) for v in self.pool.views)


def _in_process(cluster: Cluster, monkeypatch, test) -> None:  # noqa: ANN001
    """Run ``test(decode)`` against a registered in-process decode sidecar, then close it."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp")

    async def main() -> None:
        sc = InProcessSidecar(Config(peer_token=TOKEN, engine_id=f"inproc-{uuid.uuid4().hex[:6]}",
                                     staging_bytes=ONE_PULL))  # fmt: skip
        sc.start()
        decode = InProcess(cluster, sc)
        try:
            await sc.register(RegisterRequest(manifest=decode.manifest,
                                              regions=decode.pool.specs()))  # fmt: skip
            await test(decode)
        finally:
            await sc.close()
            decode.pool.close()

    asyncio.run(main())


def test_an_unsettled_staged_read_cancelled_while_it_settles_still_retires_its_pages(
    cluster, monkeypatch
):
    """The READ's own deadline ends its wait and, before its settle bound is out, its task is
    cancelled (what the pull's deadline does one loop turn later): the READ stays in flight, so
    its pages are retired all the same. Once it ended on its own, they come back: the next
    pull is staged into them."""

    async def test(d: InProcess) -> None:
        await d.staged(slot(0), slot(1), seed=40)
        reads = d.sc.pulls.reads
        settle, read = reads._settle, reads.read
        task: list[asyncio.Task] = []

        async def read_here(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            task.append(asyncio.current_task())
            return await read(*args, **kw)

        async def cancelled_settle(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            task[0].cancel()  # the READ's task, now waiting on this settle (run_to_end)
            return await settle(*args, **kw)

        monkeypatch.setattr(reads, "read", read_here)
        monkeypatch.setattr(reads, "_settle", cancelled_settle)
        for v in d.pool.views:
            v[:] = SENTINEL
        pull = await d.pull(slot(2), slot(3), seed=41, deadline_s=DEADLINE_S, frozen=True)
        monkeypatch.undo()
        assert (pull.state, pull.reason) == (PullState.FAILED, "unsettled"), pull.status()
        assert d.sc.pulls.staging.retired_bytes == ONE_PULL  # the whole buffer
        staged = d.sc.pulls.staging.staged
        async with asyncio.timeout(30):  # resumed: the quarantined READ ends and is released
            while reads.quarantined:
                await asyncio.sleep(0.01)
        assert d.untouched() == 0  # it landed in the retired pages
        assert d.sc.pulls.staging.retired_bytes == 0  # and they came back
        pull = await d.pull(slot(0), slot(1), seed=42)
        assert pull.state is PullState.DONE, pull.status()
        assert verify_pattern(d.manifest, d.pool.views, slot(0), seed=42) is None
        assert d.sc.pulls.staging.staged == staged + 1  # staged into them

    _in_process(cluster, monkeypatch, test)


def test_a_staged_read_given_up_in_quarantine_keeps_its_pages_retired(cluster, monkeypatch):
    """The prefill frozen past the quarantine's bound (shortened): the READ is given up, its
    peer forgotten, while it may still write its pages, so they stay retired once the prefill
    resumed. Later pulls read direct, byte-exact; the failed pull's blocks keep the sentinel."""

    async def test(d: InProcess) -> None:
        await d.staged(slot(0), slot(1), seed=70)
        reads, staging = d.sc.pulls.reads, d.sc.pulls.staging
        monkeypatch.setattr(reads_mod, "QUARANTINE_S", 0.5)
        ticket = await asyncio.to_thread(hold, cluster.pod, slot(3), 71, 5.0)
        for v in d.pool.views:
            v[:] = SENTINEL
        before = d.pool.snapshot()
        with _frozen(cluster):
            failed = d.sc.pulls.start(
                PullRequest(tickets=[ticket], block_ids=slot(2), deadline_s=DEADLINE_S)
            )
            async with asyncio.timeout(60):
                await failed.done.wait()
                assert (failed.state, failed.reason) == (PullState.FAILED, "unsettled")
                while reads.quarantined:  # given up while the prefill is still frozen
                    await asyncio.sleep(0.01)
        assert staging.retired_bytes == ONE_PULL and d.untouched() == 0
        staged = staging.staged
        pull = await d.pull(slot(0), slot(1), seed=72)  # a fresh handshake: the peer was cut
        assert pull.state is PullState.DONE, pull.status()
        assert verify_pattern(d.manifest, d.pool.views, slot(0), seed=72) is None
        assert changed_outside(before, d.pool.views, d.manifest, slot(0)) == 0
        assert staging.staged == staged and staging.retired_bytes == ONE_PULL  # read direct

    _in_process(cluster, monkeypatch, test)


class _Clock:
    """``time`` for kvxferd.sidecar.pulls alone: its monotonic clock ``skew`` seconds ahead."""

    def __init__(self) -> None:
        self.skew = 0.0
        self.time = time.time

    def monotonic(self) -> float:
        return time.monotonic() + self.skew


def test_a_staged_read_seen_done_only_past_the_deadline_is_not_scattered(cluster, monkeypatch):
    """The READ is DONE, but by the pull's clock its deadline passed as the completion was
    seen (a stalled loop): nothing is scattered, the pull ends FAILED ``deadline`` and the
    pages come back (the next pull is staged)."""

    async def test(d: InProcess) -> None:
        await d.staged(slot(0), slot(1), seed=50)
        reads, clock = d.sc.pulls.reads, _Clock()
        read = reads.read

        async def read_then_late(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            done = await read(*args, **kw)
            clock.skew = 3600.0  # seen DONE an hour past the deadline
            return done

        monkeypatch.setattr(reads, "read", read_then_late)
        monkeypatch.setattr(pulls, "time", clock)
        for v in d.pool.views:
            v[:] = SENTINEL
        pull = await d.pull(slot(2), slot(3), seed=51)
        monkeypatch.undo()
        assert d.untouched() == 0  # nothing scattered
        assert (pull.state, pull.reason) == (PullState.FAILED, "deadline"), pull.status()
        staged = d.sc.pulls.staging.staged
        await d.staged(slot(0), slot(1), seed=52)
        assert d.sc.pulls.staging.staged == staged + 1  # its pages came back

    _in_process(cluster, monkeypatch, test)
