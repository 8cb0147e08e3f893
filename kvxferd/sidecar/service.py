"""The sidecar of one engine rank: registration, holds (prefill side), pulls (decode side).

Runs on one asyncio loop. Slow NIXL calls (registration, metadata, large posts) go to worker
threads, completion and notifications are polled on the loop; hold bookkeeping stays on the
loop (HoldTable is not thread-safe by design). Two background tasks: the reaper, which expires
leases in deadline order, and the notification poller, which releases holds once every expected
reader has notified.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

from msgspec import structs

from kvxferd import __version__, descriptors
from kvxferd.aio import wait_while
from kvxferd.config import Config
from kvxferd.errors import (
    AlreadyRegisteredError,
    DuplicateHoldError,
    FabricNotReadyError,
    IncompatiblePeerError,
    MemoryInUseError,
    NotRegisteredError,
    PodConflictError,
    RegisterInProgressError,
    SegmentTooSmallError,
    StaleGenerationError,
)
from kvxferd.layout import validate_manifest
from kvxferd.memory import check_sources, first_shrunk
from kvxferd.metrics import Metrics
from kvxferd.sidecar.clocks import act_by, wall_time
from kvxferd.sidecar.fabric import Fabric
from kvxferd.sidecar.handshake import mismatch, our_handshake
from kvxferd.sidecar.hold_request import check_hold_rank
from kvxferd.sidecar.holds import HoldTable
from kvxferd.sidecar.keepalive import decline_at_peers, keep_alive
from kvxferd.sidecar.notifs import NotificationPoller
from kvxferd.sidecar.offload import STOP_S, Offload
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.placements import Placements
from kvxferd.sidecar.pod import Pod, RankMemory
from kvxferd.sidecar.pull_request import ReaderCounts, check_reader_tp
from kvxferd.sidecar.pulls import Pull, PullRunner
from kvxferd.sidecar.reaper import reap
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.sidecar.sources import (
    Retired,
    check_let_go,
    close_sources,
    host_views,
    map_sources,
    release_sources,
)
from kvxferd.sidecar.tickets import check_addressed, sign_ticket, verify_ticket, verify_tickets
from kvxferd.transport import Agent, StripedAgent
from kvxferd.wire import (
    ENGINE_API_VERSION,
    AbortHoldRequest,
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    FinishedPulls,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
    HoldRequest,
    Identity,
    KeepaliveRequest,
    Manifest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    ReleasedHolds,
    Ticket,
    UnregisterRequest,
)

log = logging.getLogger(__name__)

GENERATION_SPAN = 1 << 48
"""Registration generations start at a random number below this (exact in JSON doubles)."""


class Sidecar:
    """One engine rank's transfer daemon; the engine and peer APIs are thin layers over it."""

    def __init__(self, config: Config, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.epoch = time.time_ns()
        self.engine_id = config.engine_id or f"kvx-{secrets.token_hex(4)}"
        self.peer_address = ""  # host:port, set once the peer server is bound
        self.frames_port = 0  # the framed peer listener's port (0: not served), named in handshakes
        striped = {"stripes": config.read_stripes} if config.read_stripes > 1 else {}
        self.agent = (StripedAgent if striped else Agent)(
            f"{self.engine_id}-{self.epoch}",
            backends=list(config.backends),
            progress_thread=config.progress_thread,
            **striped,
        )
        self.metrics.set_backend(",".join(config.backends))
        self.manifest: Manifest | None = None
        self._regions: list[Any] = []
        self._bases: list[int] = []
        self._sources: list[int] = []  # source (allocation) index of each manifest region
        self.holds: HoldTable | None = None
        self.keys = PeerKeys.of(config.peer_token, config.peer_token_previous) if (
            config.peer_token) else None  # fmt: skip
        self.peers = PeerTable(
            local_handshake=self._local_handshake,
            add_agent=lambda md: asyncio.to_thread(self.agent.add_remote, md),
            remove_agent=lambda name: asyncio.to_thread(self.agent.remove_remote, name),
            check_compatible=self._compare,
            keys=self.keys,
            timeout_s=config.handshake_timeout_s,
            on_change=self.metrics.peers_changed,
            on_call=lambda call, wire: self.metrics.peer_calls.labels(call, wire).inc(),
        )
        self.pulls = PullRunner(
            local=self._local_layout, transport=self.agent, peers=self.peers, metrics=self.metrics,
            prepped_reads=config.prepped_reads, max_in_flight=config.max_pulls_in_flight,
            max_deadline_s=config.max_pull_deadline_s, guard=self._check_memory,
            reads_over_tcp=lambda: self.fabric.reads_over_tcp(time.monotonic()),
            local_views=self._host_views, staging_bytes=config.staging_bytes,
            staging_min_descriptors=config.staging_min_descriptors,
        )  # fmt: skip
        self._tasks: list[asyncio.Task[None]] = []
        self._secret = config.peer_token.encode()
        self._accepted = self.keys.accepted if self.keys is not None else (self._secret,)
        self._placements = Placements()  # claims waiting for their hold to be placed
        self._a_release = asyncio.Event()  # set on every release (unregister waits on it)
        self._readers = ReaderCounts()
        self.generation = -1  # registration generation; -1 while no engine is registered
        self.instance = ""  # the registered engine's RegisterRequest.instance
        self._registering = False  # a register is mapping and registering its memory
        self._leaving = False  # an unregister is letting the memory go: refuse new work on it
        # Each process numbers its registrations from a random point, so a generation an engine
        # kept from before a sidecar restart names no registration of this process: numbered
        # from 0, the first registrant after a restart had the very number the engine kept, and
        # that engine's holds and pulls went to the other's memory.
        self._next_generation = secrets.randbelow(GENERATION_SPAN)
        self._registrations: list[Any] = []  # NIXL registrations of the memory sources
        self._retired = Retired()  # zero pages where unregistered memory was, until close
        self._shrunk: tuple[str, str] | None = None  # (field, why) once a segment shrank
        give_up = lambda hold_id: self.abort(AbortHoldRequest(hold_id=hold_id))  # noqa: E731
        self.pod = Pod(config.pod_ranks, give_up) if config.pod_ranks > 1 else None
        self.offload = Offload(config, self.metrics, self._store_target, self._pinning,
                               self._check_memory)  # fmt: skip
        self.fabric = Fabric(config.require_transport, config.ucx_proto_log,
                             metric=self.metrics.fabric_transports)  # fmt: skip
        self.notifs = NotificationPoller(
            agent=self.agent, holds=lambda: self.holds, fabric=self.fabric, metrics=self.metrics,
            progress_thread=config.progress_thread, after_release=self._after_release,
        )  # fmt: skip

    # ---------------------------------------------------------------- lifecycle

    @property
    def ready(self) -> bool:
        """An engine has registered and the agent is up."""
        return self.manifest is not None

    def readiness(self) -> dict[str, Any]:
        """The /readyz body (FabricNotReadyError when the data plane is not as required, or a
        registered segment shrank)."""
        if self.manifest is not None:
            try:
                self._check_memory()
            except SegmentTooSmallError as exc:
                raise FabricNotReadyError(f"registered memory: {exc}") from None
        return self.fabric.readiness()

    def start(self) -> None:
        """Start the background tasks (call from the running loop)."""
        self._tasks = [
            asyncio.create_task(
                reap(lambda: self.holds, self._after_release), name="kvxferd-reaper"
            ),
            asyncio.create_task(self.notifs.run(), name="kvxferd-notifs"),
        ]

    async def close(self) -> None:
        """Stop tasks, fail in-flight pulls, release NIXL state and unmap regions (not while a
        store copy may still touch them: their views keep them mapped until it ends)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pulls.close()
        await self.peers.close()
        copying = await self.offload.shutdown(STOP_S)  # bounded; warns if copies still run
        await asyncio.to_thread(self.agent.close)
        self._retired.close()  # no UCX worker left to serve a late READ of them
        self.fabric.close()
        if not copying:  # else left mapped: no store copy reads or writes memory let go of
            close_sources(self._regions)
        if self.pod is not None and self.manifest is None:  # ranks of a pod still forming
            close_sources([r for m in self.pod.reset() for r in m.regions])
        self._regions = []

    # ---------------------------------------------------------------- engine API

    async def register(self, req: RegisterRequest) -> RegisterResponse:
        """Map the engine's regions, register them with NIXL once each, adopt the manifest.

        One at a time: a register that arrives while another is still mapping and registering
        is refused like one that finds an engine registered (both would otherwise succeed and
        be told the same generation)."""
        if self._registering:  # checked first: its manifest is set before its self-test ends
            raise RegisterInProgressError("register: another engine's register is in progress")
        if self.manifest is not None and self.pod is None:  # a pod: its ranks' slots are taken
            raise AlreadyRegisteredError(
                "register: this sidecar already has an engine; restart it first"
            )
        validate_manifest(req.manifest)
        sources = check_sources(req)
        if self.pod is not None:
            if self._leaving:  # a repeat would be answered the registration being let go
                raise RegisterInProgressError("register: the pod is unregistering (its memory "
                                              "is being let go); retry")  # fmt: skip
            return await self.pod.register(
                req, sources, agent=self.agent, adopt=self._adopt,
                timeout_s=self.config.pod_register_timeout_s,
            )  # fmt: skip
        self._registering = True  # set before the first await: no second register gets past
        try:
            return await self._register(req, sources)
        finally:
            self._registering = False

    async def _register(self, req: RegisterRequest, sources: list[int]) -> RegisterResponse:
        mapped = await map_sources(self.agent, req, sources)
        return await self._adopt(RankMemory(req.manifest, *mapped, sources, req.instance))

    async def _adopt(self, memory: RankMemory) -> RegisterResponse:
        """Publish mapped memory (a pod's: every rank's, rank 0's manifest and bases) as the
        registration under a new generation, then run the fabric self-test over it."""
        regions = self._regions = memory.regions
        self._registrations, self._bases = memory.registrations, memory.bases
        self._sources, self._shrunk = memory.sources, None
        generation = self.generation = self._next_generation
        self._next_generation += 1
        self.instance = memory.instance
        self.manifest = structs.replace(memory.manifest, engine_id=self.engine_id,
                                        epoch=self.epoch)  # fmt: skip
        holds = self.holds = HoldTable.configured(self.manifest, self.config)
        self._registering = True  # no unregister during the self-test READ
        try:
            await self.fabric.run_self_test(self.agent, regions, lambda: self.notifs.poll(holds))
        finally:
            self._registering = False
        m = self.manifest
        log.info("registered %s: %d regions, %d groups, %d blocks", m.model, len(regions),
                 len(m.groups), m.num_blocks)  # fmt: skip
        return RegisterResponse(
            engine_id=self.engine_id,
            epoch=self.epoch,
            peer_address=self.peer_address,
            generation=generation,  # ours, even if an unregister ran during the self-test
        )

    async def unregister(self, req: UnregisterRequest) -> None:
        """Forget the engine's memory: pulls end FAILED (no READ left running), holds are
        released ``unregistered`` (a claimed one once its readers notified or its claims
        ended), NIXL registrations dropped, sources unmapped; calls that need the engine
        meanwhile are refused (503). Store loads stop before their next entry (the one being
        copied finishes); it waits up to ``STOP_S`` for them, the store saves and the claimed
        holds to end. While a quarantined READ may still write the memory, a decode may still
        read it, or a store copy still runs, pulls and holds end all the same but the memory
        stays registered and mapped (MemoryInUseError, 503: retry once those ended). Unmapped
        memory leaves zero pages at its addresses (``Retired``): a reader stalled past its
        claim may still have READ copies queued in our UCX worker (TCP), which copy zeros."""
        holds, _ = self._require_engine()
        if self._registering:  # its self-test READ may still read the memory
            raise MemoryInUseError(
                "unregister: the registration is still being set up (its self-test READ); retry"
            )
        if req.generation != self.generation:
            raise StaleGenerationError(
                f"unregister: generation {req.generation} is not the registered {self.generation}"
            )
        self._leaving = True  # from here on no new pull (nor claim, hold) uses this memory
        try:
            await self.pulls.stop()  # cancelled pulls end FAILED once their READs stopped
            for hold in list(holds.live()):  # the engine lets its blocks go: no more claims
                holds.abort(hold.hold_id, reason="unregistered")  # a claimed one once read
            self._after_release()
            copying, _ = await asyncio.gather(
                self.offload.stop(STOP_S),  # loads stop, saves end: bounded
                # decodes finish READs they were granted (released by notification or claim end)
                wait_while(lambda: len(holds) > 0, self._a_release, STOP_S),
            )
            # now: some holds may have been read while the store copies ended
            claims = [h.claimed_until - time.monotonic() for h in holds.live()]
            check_let_go(claims, self.pulls.reads.quarantined, copying)
            await self.pulls.close()
            await release_sources(self.agent, self._registrations, self._regions, self._retired)
            self._regions, self._registrations, self._bases = [], [], []
            if self.pod is not None:  # every rank's memory went above: a fresh pod forms next
                self.pod.reset()
            self.manifest = None
            self.generation = -1
            self.instance = ""
        finally:
            self._leaving = False
        log.info("unregistered generation %d", req.generation)

    def identity(self) -> Identity:
        """Who this sidecar is, so a scheduler process can mint tickets for its holds."""
        m = self.manifest
        return Identity(
            engine_id=self.engine_id,
            epoch=self.epoch,
            generation=self.generation,
            peer_address=self.peer_address,
            tp_rank=m.tp_rank if m is not None else -1,
            tp_size=m.tp_size if m is not None else 0,
            default_lease_s=self.config.default_lease_s,
            max_claim_s=self.config.max_claim_s,
            instance=self.instance,
            pod_ranks=self.config.pod_ranks,
            engine_api_version=ENGINE_API_VERSION,
            kvxferd_version=__version__,
        )

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin a request's blocks under a lease; the ticket authorises one pull of them."""
        holds, manifest = self._require_memory()
        in_time = lambda: act_by(req.not_after_ns, self.metrics.calls_expired.labels("hold").inc)  # noqa: E731
        check = lambda: (self._check_generation(req.generation), in_time())  # noqa: E731
        if (pod := self.pod) is None:
            check_hold_rank(req.tp_rank, manifest.tp_rank)
            self._check_generation(req.generation)
        elif ticket := pod.place(req, req.hold_id in holds, self._placements, check):
            return ticket  # a later rank's placement (one that came late gives the hold up)
        held = holds.counters.held
        try:
            hold = holds.hold(req, checked=in_time)  # the same hold placed again is that hold
        except DuplicateHoldError:  # a request placed twice: its live hold was given up
            self._after_release()
            raise
        if pod is None:
            self._placements.placed(hold.hold_id)  # a claim for this engine-chosen id came first
        self.metrics.holds_created.inc(holds.counters.held - held)
        self.notifs.wake.set()  # a READ may come before its claim: progress UCX promptly
        self.metrics.holds_active.set(holds.active)
        signed = sign_ticket(Ticket(
            engine_id=self.engine_id,
            epoch=self.epoch,
            hold_id=hold.hold_id,
            request_id=req.request_id,
            block_ids=req.block_ids,
            num_tokens=req.num_tokens,
            expires_at=wall_time(hold.expires_at),
            tp_rank=manifest.tp_rank,
            tp_size=manifest.tp_size,
            peer=self.peer_address,
            generation=self.generation,
            ranks=self.config.pod_ranks,
        ), self._secret)  # fmt: skip
        return pod.placements.first(req, signed) if pod is not None else signed

    def abort(self, req: AbortHoldRequest) -> None:
        """Give up a hold: released now, or, while a reader that claimed it may be reading,
        once its readers are done (``HoldTable.abort``); the released feed says when."""
        holds, _ = self._require_engine()
        try:
            holds.abort(req.hold_id)
        finally:  # an id no hold has is never placed now: a claim waiting for it ends at once
            self._placements.placed(req.hold_id)
        self._after_release()

    async def start_pull(self, req: PullRequest) -> PullAccepted:
        """Validate a pull and start it in the background."""
        self._require_reader(req.generation)
        # Every ticket's MAC before anything else: a forged ticket never causes a connection.
        verify_tickets(req.tickets, self._accepted)
        pull = self.pulls.start(req)
        return PullAccepted(pull_id=pull.pull_id)

    async def pull_status(self, pull_id: str, wait_s: float) -> PullStatus:
        """A pull's status, waiting up to ``wait_s`` for it to finish."""
        return await self.pulls.status(pull_id, wait_s)

    async def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull to its end and answer its final status."""
        self._require_reader(req.generation)
        verify_tickets(req.tickets, self._accepted)  # before any network call, as start_pull
        return await self.pulls.run(req)

    def finished_pulls(self, cursor: int, limit: int) -> FinishedPulls:
        """The finished-pulls feed from ``cursor`` (one page of at most ``limit``)."""
        return self.pulls.finished_since(cursor, limit)

    async def keepalive(self, req: KeepaliveRequest) -> HeartbeatResponse:
        """Heartbeat the holds behind a decode engine's queued tickets at their prefill sides."""
        self._require_engine()
        return await keep_alive(self.peers, req, self._accepted)

    async def decline(self, req: DeclineRequest) -> DeclineResponse:
        """Tell each prefill side to release the holds behind tickets this engine will not read
        (every MAC checked here first)."""
        self._require_engine()
        return await decline_at_peers(self.peers, req, self._accepted)

    def released_since(self, cursor: int, limit: int | None = None) -> ReleasedHolds:
        """One page of the released-holds feed from ``cursor``."""
        holds, _ = self._require_engine()
        return holds.released_since(cursor, limit)

    # ---------------------------------------------------------------- peer API

    async def accept_handshake(self, theirs: Handshake) -> Handshake:
        """Answer a reader's handshake with ours (after checking compatibility)."""
        _, manifest = self._require_engine()
        diff = mismatch(manifest, theirs, self.agent.tcp_segments[0])
        if diff:
            self.metrics.handshakes.labels("incompatible").inc()
            raise IncompatiblePeerError(diff)
        self.metrics.handshakes.labels("accepted").inc()
        return self._local_handshake()

    async def claim(self, req: ClaimRequest) -> ClaimResponse:
        """Pin a hold for a reader; unknown -> 404, expired -> 410 (and released).

        Checked first: the ticket's MAC (401), that it names this engine epoch and registration
        generation (404), this rank's TP shape (409) and a reader TP size the manifest allows
        (422). The hold must have the ticket's block ids (409). An engine-chosen hold id not
        placed yet is waited for up to ``hold_grace_s`` (the generation is checked again
        after: a hold placed under a newer registration is not the ticket's). No claim while a
        registered segment is shrunk (422 SegmentTooSmallError).
        """
        _, manifest = self._require_memory()
        ticket = req.ticket
        verify_ticket(ticket, self._accepted)
        ranks = self.config.pod_ranks
        check_addressed(ticket, self.engine_id, self.epoch, self.generation, manifest, ranks)
        readers = self._readers.expected(manifest, req.reader_tp_size, self.pod is not None)
        await self._await_hold(ticket.hold_id)
        holds, manifest = self._require_engine()  # again: it may have re-registered meanwhile
        check_addressed(ticket, self.engine_id, self.epoch, self.generation, manifest, ranks)
        if self.pod is not None:  # a rank never placed it: given up
            self.pod.check_placed(ticket.hold_id, self._placements)
        try:
            grant = holds.claim(
                ticket.hold_id, req.reader, req.claim_s, readers,
                block_ids=ticket.block_ids, request_id=ticket.request_id,
                reader_tp_size=req.reader_tp_size,
            )  # fmt: skip
        finally:
            self._after_release()
        self.notifs.claimed(holds)  # progress now: the READ may wait on our UCX worker
        return ClaimResponse(
            hold_id=grant.hold_id,
            expires_at=wall_time(grant.expires_at),
            expected_readers=readers,
            claim_s=grant.granted_s,
        )

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        """Extend leases of still-queued requests."""
        holds, _ = self._require_engine()
        extended, missing = holds.heartbeat(req.hold_ids, req.extend_s)
        return HeartbeatResponse(extended=list(extended), missing=list(missing))

    def accept_decline(self, req: DeclineRequest) -> DeclineResponse:
        """Release holds a decode side will not read (``declined``). Every ticket's MAC is
        checked first (401 naming it); a ticket whose hold is gone, belongs to another engine
        epoch or registration generation or has other block ids or request is ``missing``; a
        claimed hold is ``busy`` (kept)."""
        holds, _ = self._require_engine()
        verify_tickets(req.tickets, self._accepted)
        out = holds.decline_tickets(req.tickets, (self.engine_id, self.epoch, self.generation))
        self._after_release()
        if out.released:
            log.info("declined (%s): %d holds released", req.reason or "no reason",
                     len(out.released))  # fmt: skip
        return out

    # ---------------------------------------------------------------- internals

    async def _await_hold(self, hold_id: str) -> None:
        """Wait (up to ``hold_grace_s``) for a hold that is neither live nor released yet."""
        holds = self.holds
        grace = self.config.hold_grace_s
        pending = self.pod is not None and self.pod.placements.pending(hold_id)
        if holds is None or grace <= 0 or holds.was_released(hold_id) or (
                hold_id in holds and not pending):  # fmt: skip
            return
        await self._placements.wait(hold_id, grace)

    def _require_engine(self) -> tuple[HoldTable, Manifest]:
        if self.manifest is None or self.holds is None:
            raise NotRegisteredError("no engine has registered with this sidecar yet")
        if self._leaving:
            raise NotRegisteredError("the engine is unregistering: its memory is being let go")
        return self.holds, self.manifest

    def _require_reader(self, generation: int | None) -> None:
        """:meth:`_require_engine` and :meth:`_check_generation` of a sidecar that may pull (a
        rank's own: a prefill pod's only holds)."""
        self._require_engine()
        self._check_generation(generation)
        if self.pod is not None:
            raise PodConflictError("tickets", f"a prefill pod sidecar (--pod-ranks "
                                   f"{self.pod.ranks}) does not pull; a decode rank pulls "
                                   "through its own")  # fmt: skip

    def _check_generation(self, generation: int | None) -> None:
        """Refuse an engine call whose block ids mean an earlier registration's memory (None:
        unchecked): an engine that registered since (two given one socket) would be written."""
        if generation is not None and generation != self.generation:
            raise StaleGenerationError(f"generation: {generation} is not the registered "
                                       f"{self.generation} (registered again since)")  # fmt: skip

    def _require_memory(self) -> tuple[HoldTable, Manifest]:
        """:meth:`_require_engine`, and the engine's memory still all there (for work that
        touches it or lets a READ touch it)."""
        out = self._require_engine()
        self._check_memory()
        return out

    def _check_memory(self) -> None:
        """SegmentTooSmallError, from the first time a registered segment is seen shrunk until
        the engine registers again: a store copy (or a READ over TCP) touching its missing pages
        would kill this process (SIGBUS). One fstat per source; not caught: a truncation during
        a copy that passed this check."""
        if self._shrunk is None:
            self._shrunk = first_shrunk(self._regions)
            if self._shrunk is not None:
                log.error("registered memory %s", ": ".join(self._shrunk))
        if self._shrunk is not None:
            raise SegmentTooSmallError(*self._shrunk)

    def _store_target(self, generation: int | None, tp_rank: int) -> tuple[Manifest, list[Any]]:
        """The registered manifest and a host view of each region, for the store (a pod's:
        rank ``tp_rank``'s, :meth:`Pod.store_target`)."""
        _, manifest = self._require_engine()
        self._check_generation(generation)
        if self.pod is not None:
            return self.pod.store_target(tp_rank)
        return manifest, host_views(self._regions, self._sources, manifest)

    def _pinning(self, hold_id: str, tp_rank: int) -> tuple[list[list[int]], int, Any]:
        """``HoldTable.pinning`` for a store save by ``hold_id``; on a pod, only once rank
        ``tp_rank`` placed it (its blocks are not pinned before)."""
        out = self._require_engine()[0].pinning(hold_id)
        if self.pod is not None:
            self.pod.placements.check_rank(hold_id, tp_rank)
        return out

    @property
    def region_bases(self) -> list[int]:
        """Base address of each registered region in this process."""
        return self._bases

    def _host_views(self) -> list[Any] | None:
        """A uint8 host view of each registered region, for a staged READ's scatter (None for
        VRAM and for a pod, whose READs are never staged)."""
        _, manifest = self._require_engine()
        if self.pod is not None or any(r.mem != "DRAM" for r in manifest.regions):
            return None
        return host_views(self._regions, self._sources, manifest)

    def _local_layout(self) -> tuple[Manifest, list[int]]:
        """The registered manifest and region bases (what a pull reads into)."""
        _, manifest = self._require_engine()
        return manifest, self._bases

    def _local_handshake(self) -> Handshake:
        _, manifest = self._require_engine()
        return our_handshake(
            self.agent,
            manifest,
            self._bases,
            engine_id=self.engine_id,
            epoch=self.epoch,
            frames_port=self.frames_port,
            generation=self.generation,
            pod=self.pod and self.pod.slots.layouts(self.engine_id, self.epoch),
        )

    def _compare(self, remote: Manifest) -> dict[str, tuple[object, object]]:
        _, manifest = self._require_engine()
        return descriptors.compare_manifests(manifest, remote)

    def _after_release(self) -> None:
        """Bring the hold gauges and release counters up to date with the HoldTable."""
        self._a_release.set()
        if self.holds is None:
            return
        if self.pod is not None and len(self.pod.placements):  # pending ones released: forget
            self.pod.placements.prune(self.holds.__contains__)
        self.metrics.holds_active.set(self.holds.active)
        self.metrics.count_releases(self.holds.released_counts())


__all__ = ["Pull", "Sidecar", "check_reader_tp"]
