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

from kvxferd import descriptors
from kvxferd.config import Config
from kvxferd.errors import (
    AlreadyRegisteredError,
    KvxferdError,
    ManifestError,
    NotRegisteredError,
)
from kvxferd.layout import validate_manifest
from kvxferd.memory import open_region
from kvxferd.metrics import Metrics
from kvxferd.sidecar.holds import HoldTable
from kvxferd.sidecar.keepalive import keep_alive
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.pulls import Pull, PullRunner
from kvxferd.sidecar.tickets import sign_ticket, verify_ticket
from kvxferd.transport import Agent
from kvxferd.wire import (
    PROTOCOL_VERSION,
    AbortHoldRequest,
    ClaimRequest,
    ClaimResponse,
    FinishedPulls,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
    HoldRequest,
    KeepaliveRequest,
    Manifest,
    PullAccepted,
    PullRequest,
    PullStatus,
    RegisterRequest,
    RegisterResponse,
    ReleasedHolds,
    Ticket,
)

log = logging.getLogger(__name__)

_NOTIF_FAST_S = 0.001  # shortest poll interval, right after a claim or a notification
_NOTIF_SLOW_S = 0.05  # longest poll interval (and the interval with no hold claimed)
_NOTIF_LATENCY_SHARE = 20  # poll every elapsed/20: a READ's notification is late by <= ~5%
_REAP_MAX_SLEEP_S = 1.0


class Sidecar:
    """One engine rank's transfer daemon; the engine and peer APIs are thin layers over it."""

    def __init__(self, config: Config, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.epoch = time.time_ns()
        self.engine_id = config.engine_id or f"kvx-{secrets.token_hex(4)}"
        self.peer_address = ""  # host:port, set once the peer server is bound
        self.agent = Agent(
            f"{self.engine_id}-{self.epoch}",
            backends=list(config.backends),
            progress_thread=config.progress_thread,
        )
        self.metrics.set_backend(",".join(config.backends))
        self.manifest: Manifest | None = None
        self._regions: list[Any] = []
        self._bases: list[int] = []
        self.holds: HoldTable | None = None
        self.peers = PeerTable(
            local_handshake=self._local_handshake,
            add_agent=lambda md: asyncio.to_thread(self.agent.add_remote, md),
            remove_agent=lambda name: asyncio.to_thread(self.agent.remove_remote, name),
            check_compatible=self._compare,
            token=config.peer_token,
            timeout_s=config.handshake_timeout_s,
        )
        self.pulls = PullRunner(
            local=self._local_layout, transport=self.agent, peers=self.peers, metrics=self.metrics
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._secret = config.peer_token.encode()
        self._released_reported: dict[str, int] = {}  # release counts already in metrics
        self._notif_wake = asyncio.Event()  # set by a claim: a READ is imminent

    # ---------------------------------------------------------------- lifecycle

    @property
    def ready(self) -> bool:
        """An engine has registered and the agent is up."""
        return self.manifest is not None

    def start(self) -> None:
        """Start the background tasks (call from the running loop)."""
        self._tasks = [
            asyncio.create_task(self._reaper(), name="kvxferd-reaper"),
            asyncio.create_task(self._notif_poller(), name="kvxferd-notifs"),
        ]

    async def close(self) -> None:
        """Stop tasks, fail in-flight pulls, release NIXL state and unmap regions."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.pulls.close()
        await self.peers.close()
        await asyncio.to_thread(self.agent.close)
        for region in self._regions:
            region.close()
        self._regions = []

    # ---------------------------------------------------------------- engine API

    async def register(self, req: RegisterRequest) -> RegisterResponse:
        """Map the engine's regions, register them with NIXL once each, adopt the manifest."""
        if self.manifest is not None:
            raise AlreadyRegisteredError(
                "register: this sidecar already has an engine; restart it first"
            )
        if len(req.regions) != len(req.manifest.regions):
            raise ManifestError(
                "regions",
                f"{len(req.regions)} region sources for {len(req.manifest.regions)} regions",
            )
        validate_manifest(req.manifest)
        regions = []
        try:
            for i, (spec, region) in enumerate(zip(req.regions, req.manifest.regions, strict=True)):
                if spec.size_bytes < region.size_bytes:
                    raise ManifestError(
                        f"regions[{i}].size_bytes",
                        f"{spec.size_bytes} < manifest region size {region.size_bytes}",
                    )
                regions.append(open_region(spec))
            await asyncio.to_thread(self.agent.register, regions)
        except BaseException:
            for region in regions:
                region.close()
            raise
        self._regions = regions
        self._bases = [r.base_addr for r in regions]
        self.manifest = structs.replace(req.manifest, engine_id=self.engine_id, epoch=self.epoch)
        self.holds = HoldTable(
            self.manifest,
            default_lease_s=self.config.default_lease_s,
            max_lease_s=self.config.max_lease_s,
            clock=time.time,
        )
        log.info(
            "registered %s: %d regions, %d groups, %d blocks",
            self.manifest.model,
            len(regions),
            len(self.manifest.groups),
            self.manifest.num_blocks,
        )
        return RegisterResponse(
            engine_id=self.engine_id, epoch=self.epoch, peer_address=self.peer_address
        )

    def hold(self, req: HoldRequest) -> Ticket:
        """Pin a request's blocks under a lease; the ticket authorises one pull of them."""
        holds, manifest = self._require_engine()
        hold = holds.hold(req)
        self.metrics.holds_created.inc()
        self.metrics.holds_active.set(holds.active)
        ticket = Ticket(
            engine_id=self.engine_id,
            epoch=self.epoch,
            hold_id=hold.hold_id,
            request_id=req.request_id,
            block_ids=req.block_ids,
            num_tokens=req.num_tokens,
            expires_at=hold.expires_at,
            tp_rank=manifest.tp_rank,
            tp_size=manifest.tp_size,
            peer=self.peer_address,
        )
        return sign_ticket(ticket, self._secret)

    def abort(self, req: AbortHoldRequest) -> None:
        """Give up a hold."""
        holds, _ = self._require_engine()
        holds.abort(req.hold_id)
        self._after_release()

    async def start_pull(self, req: PullRequest) -> PullAccepted:
        """Validate a pull and start it in the background."""
        self._require_engine()
        pull = self.pulls.start(req)
        return PullAccepted(pull_id=pull.pull_id)

    async def pull_status(self, pull_id: str, wait_s: float) -> PullStatus:
        """A pull's status, waiting up to ``wait_s`` for it to finish."""
        return await self.pulls.status(pull_id, wait_s)

    async def run_pull(self, req: PullRequest) -> PullStatus:
        """Run a pull to its end and answer its final status."""
        self._require_engine()
        return await self.pulls.run(req)

    def finished_pulls(self, cursor: int, limit: int) -> FinishedPulls:
        """The finished-pulls feed from ``cursor`` (one page of at most ``limit``)."""
        return self.pulls.finished_since(cursor, limit)

    async def keepalive(self, req: KeepaliveRequest) -> HeartbeatResponse:
        """Heartbeat the holds behind a decode engine's queued tickets at their prefill sides."""
        self._require_engine()
        return await keep_alive(self.peers, req, self._secret)

    def released_since(self, cursor: int) -> ReleasedHolds:
        """The released-holds feed from ``cursor``."""
        holds, _ = self._require_engine()
        return holds.released_since(cursor)

    # ---------------------------------------------------------------- peer API

    async def accept_handshake(self, theirs: Handshake) -> Handshake:
        """Answer a reader's handshake with ours (after checking compatibility)."""
        self._require_engine()
        if theirs.protocol_version != PROTOCOL_VERSION:
            self.metrics.handshakes.labels("incompatible").inc()
            from kvxferd.errors import IncompatiblePeerError

            raise IncompatiblePeerError(
                {"protocol_version": (PROTOCOL_VERSION, theirs.protocol_version)}
            )
        diff = self._compare(theirs.manifest)
        if diff:
            self.metrics.handshakes.labels("incompatible").inc()
            from kvxferd.errors import IncompatiblePeerError

            raise IncompatiblePeerError(diff)
        self.metrics.handshakes.labels("accepted").inc()
        return self._local_handshake()

    def claim(self, req: ClaimRequest) -> ClaimResponse:
        """Pin a hold for a reader; unknown -> 404, expired -> 410 (and released)."""
        holds, manifest = self._require_engine()
        verify_ticket(req.ticket, self._secret)
        readers = descriptors.expected_readers(manifest, req.reader_tp_size)
        claim_s = min(req.claim_s, self.config.max_lease_s)
        try:
            hold = holds.claim(req.ticket.hold_id, req.reader, claim_s, readers)
        finally:
            self._after_release()
        self._notif_wake.set()  # the READ comes next: poll notifications fast from now on
        return ClaimResponse(
            hold_id=hold.hold_id, expires_at=hold.expires_at, expected_readers=readers
        )

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        """Extend leases of still-queued requests."""
        holds, _ = self._require_engine()
        extended, missing = holds.heartbeat(req.hold_ids, req.extend_s)
        return HeartbeatResponse(extended=list(extended), missing=list(missing))

    # ---------------------------------------------------------------- internals

    def _require_engine(self) -> tuple[HoldTable, Manifest]:
        if self.manifest is None or self.holds is None:
            raise NotRegisteredError("no engine has registered with this sidecar yet")
        return self.holds, self.manifest

    @property
    def region_bases(self) -> list[int]:
        """Base address of each registered region in this process."""
        return self._bases

    def _local_layout(self) -> tuple[Manifest, list[int]]:
        """The registered manifest and region bases (what a pull reads into)."""
        _, manifest = self._require_engine()
        return manifest, self._bases

    def _local_handshake(self) -> Handshake:
        _, manifest = self._require_engine()
        return Handshake(
            protocol_version=PROTOCOL_VERSION,
            engine_id=self.engine_id,
            epoch=self.epoch,
            agent_name=self.agent.name,
            agent_metadata=self.agent.get_agent_metadata(),
            manifest=manifest,
            region_bases=self._bases,
        )

    def _compare(self, remote: Manifest) -> dict[str, tuple[object, object]]:
        _, manifest = self._require_engine()
        return descriptors.compare_manifests(manifest, remote)

    def _after_release(self) -> None:
        """Bring the hold gauges and release counters up to date with the HoldTable."""
        if self.holds is None:
            return
        self.metrics.holds_active.set(self.holds.active)
        for reason, count in self.holds.released_counts().items():
            delta = count - self._released_reported.get(reason, 0)
            if delta > 0:
                self.metrics.holds_released.labels(reason).inc(delta)
                self._released_reported[reason] = count

    async def _reaper(self) -> None:
        """Expire leases in deadline order; sleeps until the next deadline (bounded)."""
        while True:
            if self.holds is not None:
                self.holds.reap()
                self._after_release()
                nxt = self.holds.next_deadline()
                delay = _REAP_MAX_SLEEP_S if nxt is None else max(0.0, nxt - time.time())
            else:
                delay = _REAP_MAX_SLEEP_S
            await asyncio.sleep(min(delay, _REAP_MAX_SLEEP_S) + 0.001)

    async def _notif_poller(self) -> None:
        """Turn readers' NIXL notifications into hold releases.

        Each poll also progresses our UCX worker, which a reader's READ needs to complete when
        the progress thread is off. After a claim (or a notification) the poller is fast, then
        backs off in proportion to the time since: polling every ``elapsed / 20`` (1 ms to
        50 ms) delays a READ that took ``t`` by at most ~t/20, and a claimed hold whose reader
        never reads costs 20 polls a second instead of 1,000. ``get_new_notifs`` is called on
        the loop: it releases the GIL and costs microseconds, a thread hop costs more.
        """
        hot_since = time.monotonic()
        while True:
            delay = _NOTIF_SLOW_S
            if self.holds is not None:
                try:
                    notifs = self.agent.get_notifs()
                except KvxferdError as exc:
                    log.warning("reading notifications failed: %s", exc)
                    notifs = {}
                for reader, messages in notifs.items():
                    for message in messages:
                        self.holds.notify(message.decode(errors="replace"), reader)
                if notifs:
                    self._after_release()
                    hot_since = time.monotonic()  # more may follow (other ranks, other pulls)
                if self.holds.claimed:
                    elapsed = time.monotonic() - hot_since
                    delay = min(max(elapsed / _NOTIF_LATENCY_SHARE, _NOTIF_FAST_S), _NOTIF_SLOW_S)
            live = self.agent.live_handles()
            self.metrics.nixl_handles.set(live.transfers + live.prepped)
            if await _woken(self._notif_wake, delay):
                hot_since = time.monotonic()
            self._notif_wake.clear()


async def _woken(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``event``; whether it was set."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


__all__ = ["Pull", "Sidecar"]
