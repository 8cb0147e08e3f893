"""Pulls on the decode side: handshake, plan every prefill rank's READ at once, then claim
and read from each rank concurrently, then notify (a pod sidecar, serving every prefill rank:
one claim, one READ of every rank's memory, one notification; kvxferd.sidecar.readplans).

A pull moves forward through PullState and ends DONE only when every source rank's claim
succeeded and its READ completed; anything else ends FAILED with a reason code, never DONE
(fail closed), and only once none of its READs can still write (kvxferd.sidecar.reads). The
READ is posted while its claim is in flight (the claim is off the critical path), yet never
counts past the claim: it must complete by the earlier of the pull's deadline and the claim's
end, and the hold is notified only after both the claim answered and the READ completed.
proto/README.md ("The claim off the critical path") has the argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from kvxferd.errors import (
    CapacityError,
    ClaimTimeoutError,
    HandshakeError,
    HoldExpiredError,
    KvxferdError,
    PeerDisconnectedError,
    TransferTimeoutError,
    UnknownPullError,
    reason_code,
)
from kvxferd.metrics import BYTE_KINDS, PHASES
from kvxferd.sidecar.clocks import act_by
from kvxferd.sidecar.finished import FinishedFeed
from kvxferd.sidecar.peerviews import PeerRead
from kvxferd.sidecar.pull_record import Pull
from kvxferd.sidecar.pull_request import validate_pull
from kvxferd.sidecar.readplans import ReadPlanner
from kvxferd.sidecar.reads import SETTLE_S, Reads, run_to_end
from kvxferd.sidecar.staging import StagingPool
from kvxferd.sidecar.states import PullState
from kvxferd.wire import (
    ClaimRequest,
    FinishedPulls,
    Manifest,
    PullRequest,
    PullStatus,
    Ticket,
)

if TYPE_CHECKING:
    from kvxferd.metrics import Metrics
    from kvxferd.sidecar.peers import Peer, PeerTable
    from kvxferd.transport.base import PostedRead, Transport

LocalLayout = Callable[[], tuple[Manifest, Sequence[int]]]
"""The registered manifest and each region's base address (NotRegisteredError without one)."""
LocalViews = Callable[[], Sequence[np.ndarray] | None]
"""A uint8 host view of each registered region (None: not host memory), for staged READs."""

log = logging.getLogger(__name__)

_KEEP_FINISHED = 4096  # finished pulls remembered for status queries


class PullRunner:
    """Starts pulls as tasks (at most ``max_in_flight`` running, each deadline at most
    ``max_deadline_s``) and remembers the latest ``_KEEP_FINISHED`` outcomes."""

    def __init__(
        self,
        *,
        local: LocalLayout,
        transport: Transport,
        peers: PeerTable,
        metrics: Metrics,
        prepped_reads: bool = False,
        max_in_flight: int = 1024,
        max_deadline_s: float = 600.0,
        guard: Callable[[], None] = lambda: None,
        reads_over_tcp: Callable[[], bool] = lambda: False,
        local_views: LocalViews | None = None,
        staging_bytes: int = 0,
        staging_min_descriptors: int = 0,
    ) -> None:
        self._local = local
        self._local_views = local_views  # None: READs are never staged (nothing to scatter to)
        self._reads_over_tcp = reads_over_tcp  # whether READs were seen going over TCP
        self._guard = guard  # raises once the local memory may not be touched (shrunk)
        self._transport = transport
        self._peers = peers
        self._metrics = metrics
        self._max_in_flight = max_in_flight
        self._max_deadline_s = max_deadline_s
        self._pulls: dict[str, Pull] = {}  # running ones and the latest finished ones
        self._finished: deque[str] = deque()  # ids of the finished ones in _pulls, oldest first
        self._in_flight = 0  # pulls started and not yet finished
        self._running: dict[str, asyncio.Task[None]] = {}
        # Children bound once: a labels() lookup per observation is ~10 per READ (hot path).
        self._phase = {p: metrics.phase_duration.labels(p) for p in PHASES}
        self._bytes = {k: metrics.transfer_bytes.labels(k) for k in BYTE_KINDS}
        self.reads = Reads(transport, on_stuck=peers.forget)
        self.staging = StagingPool(transport, staging_bytes if local_views else 0,
                                   on_retired=metrics.staging_retired_bytes.set)  # fmt: skip
        self.planner = ReadPlanner(
            transport, prepped_reads=prepped_reads, staging_min_descriptors=staging_min_descriptors,
            staging_max_bytes=self.staging.nbytes,
        )  # fmt: skip
        self.feed = FinishedFeed()

    def start(self, req: PullRequest) -> Pull:
        """Validate ``req`` synchronously (4xx to the engine), then run it in the background;
        CapacityError (503) while ``max_in_flight`` pulls are running."""
        local = self._local()[0]
        validate_pull(req, local, self._max_deadline_s)
        by = act_by(req.not_after_ns, self._metrics.calls_expired.labels("pull").inc)
        if self._in_flight >= self._max_in_flight:
            raise CapacityError(
                "max_pulls_in_flight", f"{self._in_flight} pulls are running; retry when one ends"
            )
        pull = Pull(pull_id=secrets.token_hex(8), request=req, validated=local)
        pull.ends_by = min(pull.started + req.deadline_s, by)
        self._pulls[pull.pull_id] = pull
        self._in_flight += 1
        self._metrics.pulls_in_flight.inc()
        task = asyncio.create_task(self._run(pull), name=f"pull-{pull.pull_id}")
        self._running[pull.pull_id] = task
        task.add_done_callback(lambda _: self._ended(pull))
        return pull

    def _ended(self, pull: Pull) -> None:
        """Its task is over: a task cancelled before its coroutine ran a line (an unregister or
        shutdown in the loop turn of its start) never reached ``_run``'s ``finally``; it posted
        nothing, so it ends FAILED here."""
        self._running.pop(pull.pull_id, None)
        if not pull.done.is_set():
            self._fail(pull, "cancelled", "pull cancelled before it started")
            self._finish(pull)

    async def status(self, pull_id: str, wait_s: float) -> PullStatus:
        """Status of a pull, long-polling up to ``wait_s`` for it to finish."""
        pull = self._pulls.get(pull_id)
        if pull is None:
            raise UnknownPullError(f"no pull {pull_id!r} on this sidecar")
        if wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pull.done.wait(), wait_s)
        return pull.status()

    def cancel(self, pull_id: str) -> Pull:
        """Cancel a running pull: it ends FAILED (``cancelled``) once its READs settled."""
        pull = self._pulls.get(pull_id)
        if pull is None:
            raise UnknownPullError(f"no pull {pull_id!r} on this sidecar")
        task = self._running.get(pull_id)
        if task is not None:
            task.cancel()
        return pull

    async def run(self, req: PullRequest) -> PullStatus:
        """Start a pull and answer its final status (one engine call per pull).

        Bounded: a pull ends by its deadline plus the time its READs take to settle.
        """
        pull = self.start(req)
        bound = req.deadline_s + SETTLE_S + 5.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pull.done.wait()), bound)
        return pull.status()

    def finished_since(self, cursor: int, limit: int) -> FinishedPulls:
        """The finished-pulls feed from ``cursor`` (one page)."""
        return self.feed.since(cursor, limit)

    async def stop(self) -> None:
        """Cancel running pulls, and any started meanwhile, until none runs (each ends FAILED
        once its READs settled or were quarantined)."""
        while running := [t for t in self._running.values() if not t.done()]:
            for task in running:
                task.cancel()
            for task in running:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def close(self) -> None:
        """Cancel running pulls (they end FAILED once their READs settled), then stop the READs
        (quarantined ones are released)."""
        await self.stop()
        await self.reads.close()
        self.planner.close()
        await self.staging.close()

    async def _run(self, pull: Pull) -> None:
        m = self._metrics
        req = pull.request
        assert req is not None  # dropped only once the pull ended
        deadline = pull.ends_by
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                local, bases = self._local()  # one registration for the whole pull
                pod = req.tickets[0].ranks > 1  # one sidecar serves every prefill rank
                ranks = self.planner.rank_plans.get(local, req.tickets[0].tp_size)
                tickets = req.tickets if pod else [req.tickets[r] for r in ranks.sources]
                # A TaskGroup, not gather: one failed read cancels its siblings, so no READ is
                # still running (and no handle still live) once the pull reports FAILED.
                async with asyncio.TaskGroup() as group:
                    for r in () if pod else ranks.unread:  # a pod's one hold is read by all
                        group.create_task(self._release_unread(req.tickets[r], local.tp_size))
                    peers = await self._handshake(pull, tickets)
                    self._guard()  # the memory READs write is still whole (the pull FAILS)
                    checked = pull.validated is local  # local ids checked once per pull
                    if pod:
                        plans = [self.planner.pod(req, peers[0], ranks.sources, local, bases,
                                                  local_checked=checked)]  # fmt: skip
                    else:
                        plans = self.planner.ranks(req, peers, tickets, local, bases,
                                                   local_checked=checked)  # fmt: skip
                    for peer, ticket, plan in zip(peers, tickets, plans, strict=True):
                        group.create_task(
                            self._read_from(pull, peer, ticket, plan, deadline, local)
                        )
            pull.advance(PullState.DONE)
            m.pulls.labels("done").inc()
        except asyncio.CancelledError:
            # The TaskGroup has waited for every rank's READs to settle before this runs.
            self._fail(pull, "cancelled", "pull cancelled (by the engine or at shutdown)")
            raise
        except BaseException as exc:  # every failure path ends FAILED with a reason
            while isinstance(exc, BaseExceptionGroup):  # the TaskGroup's; its first cause
                exc = exc.exceptions[0]
            reason = reason_code(exc)  # the error class's own code (kvxferd.errors)
            self._fail(pull, reason, str(exc) or type(exc).__name__)
            if reason != "internal":
                log.warning("pull %s failed: %s: %s", pull.pull_id, pull.reason, pull.detail)
            else:
                log.exception("pull %s failed unexpectedly", pull.pull_id)
        finally:
            self._finish(pull)

    def _finish(self, pull: Pull) -> None:
        """Account for an ended pull (once): metrics, in-flight count, outcome, feed, waiters."""
        pull.duration_s = time.monotonic() - pull.started
        self._phase["total"].observe(pull.duration_s)
        self._metrics.pulls_in_flight.dec()
        self._in_flight -= 1
        self._remember(pull)
        self.feed.add(pull.finished())
        pull.request = pull.validated = None  # only a running pull needs them (status does not)
        pull.done.set()

    def _remember(self, pull: Pull) -> None:
        """Keep ``pull``'s outcome for status queries, forgetting the oldest finished ones past
        ``_KEEP_FINISHED`` (running pulls are never forgotten)."""
        self._finished.append(pull.pull_id)
        while len(self._finished) > _KEEP_FINISHED:
            self._pulls.pop(self._finished.popleft(), None)

    def _fail(self, pull: Pull, reason: str, detail: str) -> None:
        if pull.unsettled:
            reason, detail = "unsettled", pull.unsettled
        pull.fail(reason, detail)
        self._metrics.pulls.labels("failed").inc()
        self._metrics.pull_failures.labels(reason).inc()

    async def _handshake(self, pull: Pull, tickets: list[Ticket]) -> list[Peer]:
        """The peer of each ticket: cached ones at once, the others handshaken concurrently."""
        pull.advance(PullState.HANDSHAKING)
        t0 = time.monotonic()
        peers = [self._peers.cached(t.peer, t.engine_id, t.epoch, t.generation) for t in tickets]
        missing = [i for i, p in enumerate(peers) if p is None]
        if missing:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    i: group.create_task(
                        self._peers.get(
                            tickets[i].peer,
                            tickets[i].engine_id,
                            tickets[i].epoch,
                            tickets[i].generation,
                        )
                    )
                    for i in missing
                }
            for i, task in tasks.items():
                peers[i] = task.result()
        self._phase["handshake"].observe(time.monotonic() - t0)
        return peers  # type: ignore[return-value]  # every None was replaced

    async def _read_from(
        self, pull: Pull, peer: Peer, ticket: Ticket, plan: PeerRead, deadline: float,
        local: Manifest,
    ) -> None:  # fmt: skip
        """Claim one prefill rank's hold and read ``plan`` from it concurrently.

        The READ is posted just before the claim is sent, or, where it needs nothing from the
        prefill, just after, so it runs while the claim is in flight.
        This rank succeeds only if the claim does and the READ completed by the claim's end
        (and the pull's deadline); only then is the hold notified. A failed claim fails the
        rank once the READ settled (it can no longer write).
        """
        pull.advance(PullState.CLAIMING)
        read: asyncio.Task[tuple[float, int]] | None = None
        # A READ that waits on the prefill goes out before the claim: its completion needs one
        # progress of the prefill's UCX worker (our last notification to it is on that
        # endpoint, or the READ goes over TCP), which the claim's arrival gives
        # (NotificationPoller.claimed). Posted after the claim, it could miss that poll and
        # wait for the next paced one (p90 5 ms at concurrency 1, scripts/bench_control.py).
        # One that needs nothing from the prefill goes after the claim, while it is out (it
        # yields once, so the claim's frame leaves first unless the claim had to wait, e.g. to
        # connect: best effort, only latency). A large READ is posted by its thread meanwhile.
        read_first = bool(plan.num_descriptors) and self._read_waits(peer, plan)
        if read_first:
            read = asyncio.create_task(self._transfer(pull, peer, plan, deadline))
        claim = asyncio.create_task(self._claim(ticket, deadline, local))
        if plan.num_descriptors and not read_first:
            read = asyncio.create_task(self._transfer(pull, peer, plan, deadline, yield_=True))
        try:
            claim_end = await claim  # its error (404, 410, 401, 409, timeout) fails the rank
            pull.advance(PullState.TRANSFERRING)
            if read is not None:
                if not read.done():  # the prefill progressed its UCX worker as the claim came
                    self.reads.poller.kick()
                done, posted = await self._within_claim(pull, peer, read, claim_end, deadline)
                pull.kv_bytes += int(plan.kv_bytes)
                pull.state_bytes += int(plan.state_bytes)
                pull.descriptors += posted
                self._bytes["kv"].inc(plan.kv_bytes)  # bytes that count (claimed)
                self._bytes["state"].inc(plan.state_bytes)
                self._phase["notify"].observe(time.monotonic() - done)
            # Claimed and read: release our share of the hold (a rank with nothing to read
            # too: all its blocks were skipped).
            self._transport.send_notif(peer.agent_name, ticket.hold_id.encode())
        finally:
            await _settle(claim)
            if read is not None:
                await _settle(read)  # a READ is never abandoned (kvxferd.sidecar.reads)
                if pull.unsettled and not claim.cancelled() and claim.exception() is not None:
                    pull.unsettled += f" (its claim failed: {reason_code(claim.exception())})"

    async def _claim(self, ticket: Ticket, deadline: float, local: Manifest) -> float:
        """Claim ``ticket``'s hold until the pull's deadline; the claim's end (monotonic)."""
        m = self._metrics
        t0 = time.monotonic()
        request = ClaimRequest(
            ticket=ticket,
            reader=self._transport.name,
            reader_tp_size=local.tp_size,
            claim_s=max(0.001, deadline - time.monotonic()),
        )
        try:
            claim = await self._peers.claim(ticket.peer, request)
        except HandshakeError as exc:
            if isinstance(exc.__cause__, (TimeoutError, httpx.TimeoutException)):
                raise ClaimTimeoutError(f"claim at {ticket.peer} timed out: {exc}") from exc
            raise
        self._phase["claim"].observe(time.monotonic() - t0)
        m.lease_headroom.observe(max(0.0, ticket.expires_at - time.time()))
        # The claim's end, on our monotonic clock: the READ must be over by then. The granted
        # duration counts from before we sent the claim (no cross-host clock involved); an
        # older peer without it gives only its absolute expiry.
        if claim.claim_s > 0:
            return t0 + claim.claim_s
        return time.monotonic() + (claim.expires_at - time.time())

    async def _within_claim(
        self, pull: Pull, peer: Peer, read: asyncio.Task[tuple[float, int]], claim_end: float,
        deadline: float,
    ) -> tuple[float, int]:  # fmt: skip
        """Wait for ``read`` no longer than the claim lasts; when it completed (monotonic) and
        the descriptors it posted.

        HoldExpiredError if it did not complete by the claim's end: the hold may have expired
        under it (a READ that completed before the claim answered is checked too).
        """
        if claim_end < deadline:
            finished, _ = await asyncio.wait({read}, timeout=max(0.0, claim_end - time.monotonic()))
            if not finished:
                await _settle(read)
                if pull.unsettled:
                    pull.unsettled += " (its wait ended with its claim)"
                raise HoldExpiredError(
                    f"the claim at {peer.address} ended before the READ completed"
                )
        finished, posted = await read
        if finished > claim_end:
            raise HoldExpiredError(
                f"the claim at {peer.address} ended {finished - claim_end:.3f} s before the "
                "READ completed"
            )
        return finished, posted

    async def _release_unread(self, ticket: Ticket, reader_tp_size: int) -> None:
        """Release the hold of a prefill rank that no decode rank reads, before its expiry.

        Its units are all replicas read from other ranks, so this pull's bytes do not depend on
        it: a failure is logged (the hold then expires), never fatal.
        """
        try:
            # A claim by a TP shape that reads nothing from this rank releases its hold at once
            # (only readers that claimed may release by notification).
            await self._peers.claim(
                ticket.peer,
                ClaimRequest(ticket=ticket, reader=self._transport.name,
                             reader_tp_size=reader_tp_size, claim_s=1.0),
            )  # fmt: skip
        except KvxferdError as exc:
            log.warning(
                "could not release unread hold %s at %s (it will expire): %s",
                ticket.hold_id,
                ticket.peer,
                exc,
            )

    def _read_waits(self, peer: Peer, plan: PeerRead) -> bool:
        """Whether ``plan``'s READ may complete only once the prefill progresses its UCX worker
        (:meth:`Transport.read_waits_on_peer`; prepared lists are the main agent's, and over
        TCP every READ does)."""
        if plan.prepped is not None:
            return True
        local, remote = plan.memory
        waits = self._transport.read_waits_on_peer(
            peer.agent_name, plan.total_bytes, mem=local.mem, remote_mem=remote.mem
        )
        return waits or self._reads_over_tcp()  # the log is asked only when it decides

    async def _transfer(
        self, pull: Pull, peer: Peer, plan: PeerRead, deadline: float, *, yield_: bool = False
    ) -> tuple[float, int]:
        """Post ``plan``'s READ (no notification: that waits for the claim) and wait for it
        until the pull's deadline; when its completion was seen (monotonic; it completed no
        later) and the descriptors posted. Staged where ``plan`` has a staged form and a
        staging lease is free: the runs are read into the lease, then scattered into place
        before this returns (never once the READ failed or may still write). ``yield_``: let
        the loop round end first (a claim written in it leaves then, kvxferd.aio.Cork)."""
        if yield_:
            await asyncio.sleep(0)
        staged = plan.staged
        views = None  # where a staged READ scatters to (None: no host view, read direct)
        if staged is not None and self._local_views is not None:
            views = self._local_views()
        lease = self.staging.acquire(staged.plan.nbytes) if staged and views else None
        path = "prepped" if plan.prepped is not None else "tables"
        if lease is not None and staged is not None:
            path, nbytes, descs = "staged", staged.plan.nbytes, staged.plan.num_runs
        else:
            nbytes, descs = int(plan.kv_bytes + plan.state_bytes), int(plan.num_descriptors)
        tables = plan.tables or (None, None)
        quarantined = False  # set once the READ could not be confirmed stopped

        def on_unsettled(why: str) -> None:  # called even when this task is cancelled meanwhile
            nonlocal quarantined
            quarantined = True
            pull.unsettled = why  # this reason wins (Pull.unsettled)

        t0 = time.monotonic()
        try:
            transfer = await self.reads.read(
                peer.address,
                peer.agent_name,
                *tables,
                b"",
                nbytes=nbytes,
                descs=descs,
                deadline=deadline,
                on_unsettled=on_unsettled,
                on_ended=None if lease is None else functools.partial(self.staging.restore, lease),
                post=_by(
                    deadline,
                    plan.post(
                        self._transport, peer.agent_name, b"", None if lease is None else lease.addr
                    ),
                ),
            )
            if lease is not None and staged is not None:  # DONE: nothing writes the lease now
                if time.monotonic() > deadline:  # no write into the blocks past the deadline
                    raise TransferTimeoutError("staged READ completed past the pull's deadline")
                self._guard()  # the memory is still whole (a shrunk segment fails the pull)
                await self.staging.scatter(lease, views, staged.plan)
        except BaseException as exc:
            # Cancelled before the deadline: its pull gave it up (the claim failed or ended
            # first, another rank failed), not its path. Past it, whichever timer fired first.
            if not isinstance(exc, asyncio.CancelledError) or time.monotonic() >= deadline:
                self._metrics.read_failures.labels(path).inc()
            if isinstance(exc, PeerDisconnectedError):
                await self._peers.forget(peer.address)
            raise
        finally:
            # Retired by the report, not the error: a READ quarantined while this task was being
            # cancelled ends it in CancelledError, not UnsettledReadError (reads.run_to_end).
            if lease is not None and quarantined:  # it may still write its pages: retired
                self.staging.retire(lease)  # until the READ ends (on_ended), if it ever does
            elif lease is not None:
                self.staging.release(lease)
        finished = time.monotonic()
        telemetry = transfer.telemetry() or {}
        wire_s = float(telemetry.get("wall_s", finished - t0))
        posted = finished - wire_s
        m = self._metrics
        total = int(plan.kv_bytes + plan.state_bytes)
        self._phase["post"].observe(posted - t0)
        self._phase["wire"].observe(wire_s)
        m.transfer_duration.observe(finished - t0)
        m.transfer_descriptors.observe(descs)
        m.reads.labels(path).inc()
        if wire_s > 0:
            m.transfer_throughput.observe(total / wire_s)
        return finished, descs


def _by(deadline: float, post: Callable[[], PostedRead]) -> Callable[[], PostedRead]:
    """``post``, refused once the pull's ``deadline`` has passed (TransferTimeoutError, nothing
    posted): checked where it runs, after any wait for a peer's slot or a post thread, and
    after a stalled loop, which cancels the pull only a turn later. Posted past the deadline,
    a READ would write blocks the engine no longer counts on (vLLM recomputes them)."""

    def post_by() -> PostedRead:
        if (late := time.monotonic() - deadline) >= 0:
            raise TransferTimeoutError(f"the pull's deadline passed {late:.3f} s before its "
                                       "READ was posted: not posted")  # fmt: skip
        return post()

    return post_by


async def _settle(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` unless it ended, and wait for its end even if we are cancelled meanwhile
    (its outcome is no longer wanted, but a READ's settling must not be cut short)."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await run_to_end(task)
