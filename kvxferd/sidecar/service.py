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

from kvxferd import __version__
from kvxferd.aio import wait_while
from kvxferd.config import Config
from kvxferd.errors import (
    AlreadyRegisteredError,
    FabricNotReadyError,
    MemoryInUseError,
    RegisterInProgressError,
    SegmentTooSmallError,
    StaleGenerationError,
)
from kvxferd.layout import validate_manifest
from kvxferd.memory import check_sources
from kvxferd.metrics import Metrics
from kvxferd.sidecar.fabric import Fabric
from kvxferd.sidecar.handshake import our_handshake
from kvxferd.sidecar.holds import HoldTable
from kvxferd.sidecar.keepalive import decline_at_peers, keep_alive
from kvxferd.sidecar.notifs import NotificationPoller
from kvxferd.sidecar.offload import STOP_S, Offload
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.placements import Placements
from kvxferd.sidecar.pod import Pod, RankMemory
from kvxferd.sidecar.prefill_side import PrefillSide
from kvxferd.sidecar.pull_record import Pull
from kvxferd.sidecar.pull_request import check_reader_tp
from kvxferd.sidecar.pulls import PullRunner
from kvxferd.sidecar.reaper import reap
from kvxferd.sidecar.registered import Registered
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.sidecar.sources import (
    Retired,
    check_let_go,
    close_sources,
    map_sources,
    release_sources,
)
from kvxferd.sidecar.tickets import verify_tickets
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
    """One engine rank's transfer daemon; the engine and peer APIs are thin layers over it. It
    wires the registration (:class:`Registered`), the prefill side (:class:`PrefillSide`: holds
    and the peers' calls on them) and the decode side (:class:`PullRunner`)."""

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
        give_up = lambda hold_id: self.abort(AbortHoldRequest(hold_id=hold_id))  # noqa: E731
        self.pod = Pod(config.pod_ranks, give_up) if config.pod_ranks > 1 else None
        registered = self.registered = Registered(self.pod)  # what the engine registered
        self.keys = PeerKeys.of(config.peer_token, config.peer_token_previous) if (
            config.peer_token) else None  # fmt: skip
        self.peers = PeerTable(
            local_handshake=self._local_handshake,
            add_agent=lambda md: asyncio.to_thread(self.agent.add_remote, md),
            remove_agent=lambda name: asyncio.to_thread(self.agent.remove_remote, name),
            check_compatible=registered.compare,
            keys=self.keys,
            timeout_s=config.handshake_timeout_s,
            on_change=self.metrics.peers_changed,
            on_call=lambda call, wire: self.metrics.peer_calls.labels(call, wire).inc(),
        )
        self.pulls = PullRunner(
            local=registered.local_layout, guard=registered.check_memory,
            local_views=registered.host_views, transport=self.agent, peers=self.peers,
            metrics=self.metrics, prepped_reads=config.prepped_reads,
            max_in_flight=config.max_pulls_in_flight, max_deadline_s=config.max_pull_deadline_s,
            reads_over_tcp=lambda: self.fabric.reads_over_tcp(time.monotonic()),
            staging_bytes=config.staging_bytes,
            staging_min_descriptors=config.staging_min_descriptors,
        )  # fmt: skip
        self._tasks: list[asyncio.Task[None]] = []
        self._secret = config.peer_token.encode()
        self._accepted = self.keys.accepted if self.keys is not None else (self._secret,)
        self._placements = Placements()  # claims waiting for their hold to be placed
        self._a_release = asyncio.Event()  # set on every release (unregister waits on it)
        self._registering = False  # a register is mapping and registering its memory
        # Each process numbers its registrations from a random point, so a generation an engine
        # kept from before a sidecar restart names no registration of this process: numbered
        # from 0, the first registrant after a restart had the very number the engine kept, and
        # that engine's holds and pulls went to the other's memory.
        self._next_generation = secrets.randbelow(GENERATION_SPAN)
        self._retired = Retired()  # zero pages where unregistered memory was, until close
        self.offload = Offload(config, self.metrics, registered.store_target, registered.pinning,
                               registered.check_memory)  # fmt: skip
        self.fabric = Fabric(config.require_transport, config.ucx_proto_log,
                             metric=self.metrics.fabric_transports)  # fmt: skip
        self.notifs = NotificationPoller(
            agent=self.agent, holds=lambda: self.holds, fabric=self.fabric, metrics=self.metrics,
            progress_thread=config.progress_thread, after_release=self._after_release,
        )  # fmt: skip
        self.prefill = PrefillSide(
            registered, config, engine_id=self.engine_id, epoch=self.epoch,
            peer_address=lambda: self.peer_address, secret=self._secret, accepted=self._accepted,
            placements=self._placements, agent=self.agent, metrics=self.metrics,
            notifs=self.notifs, after_release=self._after_release,
            local_handshake=self._local_handshake,
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
                self.registered.check_memory()
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
            close_sources(self.registered.regions)
        if self.pod is not None and self.manifest is None:  # ranks of a pod still forming
            close_sources([r for m in self.pod.reset() for r in m.regions])
        self.registered.regions = []

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
            if self.registered.leaving:  # a repeat would be answered the registration being let go
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
        regions, generation = memory.regions, self._next_generation
        self._next_generation += 1
        manifest = structs.replace(memory.manifest, engine_id=self.engine_id, epoch=self.epoch)
        self.registered.adopt(memory, manifest, generation)
        holds = self.registered.holds = HoldTable.configured(manifest, self.config)
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
        registered = self.registered
        holds, _ = registered.require_engine()
        if self._registering:  # its self-test READ may still read the memory
            raise MemoryInUseError(
                "unregister: the registration is still being set up (its self-test READ); retry"
            )
        if req.generation != self.generation:
            raise StaleGenerationError(
                f"unregister: generation {req.generation} is not the registered {self.generation}"
            )
        registered.leaving = True  # from here on no new pull (nor claim, hold) uses this memory
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
            await release_sources(self.agent, registered.registrations, registered.regions,
                                  self._retired)  # fmt: skip
            registered.forget()
            if self.pod is not None:  # every rank's memory went above: a fresh pod forms next
                self.pod.reset()
        finally:
            registered.leaving = False
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
        """:meth:`PrefillSide.hold`."""
        return self.prefill.hold(req)

    def abort(self, req: AbortHoldRequest) -> None:
        """:meth:`PrefillSide.abort`."""
        self.prefill.abort(req)

    async def start_pull(self, req: PullRequest) -> PullAccepted:
        """Validate a pull and start it in the background."""
        self.registered.require_reader(req.generation)
        # Every ticket's MAC before anything else: a forged ticket never causes a connection.
        verify_tickets(req.tickets, self._accepted)
        pull = self.pulls.start(req)
        return PullAccepted(pull_id=pull.pull_id)

    async def pull_status(self, pull_id: str, wait_s: float) -> PullStatus:
        """A pull's status, waiting up to ``wait_s`` for it to finish."""
        return await self.pulls.status(pull_id, wait_s)

    async def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull to its end and answer its final status."""
        self.registered.require_reader(req.generation)
        verify_tickets(req.tickets, self._accepted)  # before any network call, as start_pull
        return await self.pulls.run(req)

    def finished_pulls(self, cursor: int, limit: int) -> FinishedPulls:
        """The finished-pulls feed from ``cursor`` (one page of at most ``limit``)."""
        return self.pulls.finished_since(cursor, limit)

    async def keepalive(self, req: KeepaliveRequest) -> HeartbeatResponse:
        """Heartbeat the holds behind a decode engine's queued tickets at their prefill sides."""
        self.registered.require_engine()
        return await keep_alive(self.peers, req, self._accepted)

    async def decline(self, req: DeclineRequest) -> DeclineResponse:
        """Tell each prefill side to release the holds behind tickets this engine will not read
        (every MAC checked here first)."""
        self.registered.require_engine()
        return await decline_at_peers(self.peers, req, self._accepted)

    def released_since(self, cursor: int, limit: int | None = None) -> ReleasedHolds:
        """One page of the released-holds feed from ``cursor``."""
        holds, _ = self.registered.require_engine()
        return holds.released_since(cursor, limit)

    # ---------------------------------------------------------------- peer API

    async def accept_handshake(self, theirs: Handshake) -> Handshake:
        """:meth:`PrefillSide.accept_handshake`."""
        return await self.prefill.accept_handshake(theirs)

    async def claim(self, req: ClaimRequest) -> ClaimResponse:
        """:meth:`PrefillSide.claim`."""
        return await self.prefill.claim(req)

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        """:meth:`PrefillSide.heartbeat`."""
        return self.prefill.heartbeat(req)

    def accept_decline(self, req: DeclineRequest) -> DeclineResponse:
        """:meth:`PrefillSide.accept_decline`."""
        return self.prefill.accept_decline(req)

    # ---------------------------------------------------------------- registration

    @property
    def manifest(self) -> Manifest | None:
        """The registered engine's manifest (None while none is registered)."""
        return self.registered.manifest

    @property
    def holds(self) -> HoldTable | None:
        """The hold table (None until an engine first registers; kept after it unregisters)."""
        return self.registered.holds

    @property
    def generation(self) -> int:
        """The registration generation (-1 while no engine is registered)."""
        return self.registered.generation

    @property
    def instance(self) -> str:
        """The registered engine's ``RegisterRequest.instance``."""
        return self.registered.instance

    @property
    def region_bases(self) -> list[int]:
        """Base address of each registered region in this process."""
        return self.registered.bases

    # The registration's memory and unregister state, as tests read them.
    _regions = property(lambda self: self.registered.regions)
    _registrations = property(lambda self: self.registered.registrations)
    _leaving = property(lambda self: self.registered.leaving)

    # ---------------------------------------------------------------- internals

    def _local_handshake(self) -> Handshake:
        _, manifest = self.registered.require_engine()
        return our_handshake(
            self.agent,
            manifest,
            self.registered.bases,
            engine_id=self.engine_id,
            epoch=self.epoch,
            frames_port=self.frames_port,
            generation=self.generation,
            pod=self.pod and self.pod.slots.layouts(self.engine_id, self.epoch),
        )

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
