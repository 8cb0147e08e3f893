"""Remote prefill sidecars this (decode) sidecar reads from: handshakes, cached per engine epoch.

A handshake exchanges protocol version, manifest and NIXL agent metadata once per
(engine id, boot epoch). A ticket with a newer epoch means the peer restarted: the old entry is
dropped (its NIXL remote agent removed) and the next pull handshakes again.

Every call is signed (kvxferd.sidecar.signing): the secret never goes on the wire, so a ticket
naming a stranger's address (which the caller refuses anyway, having checked its MAC first)
could at most show the stranger a signature valid for one request, for one window.

Claims, heartbeats and declines go as signed frames to the port the peer's handshake names
(``frames_port``; a frame costs the peer about a third of an HTTP request), and over HTTP to a
peer that names none. A framed port that refuses connections (a firewall, ``-1``) sends that
peer's calls to HTTP until it is handshaken again; nothing was sent on it, so nothing is
repeated. A call whose new connection the port closed before answering anything (a listener at
its connection cap, 1,024 by default, closes new ones unread: a flood) goes over HTTP, the peer
API's own listener and cap; the next call tries the port again. A call whose connection did not
open in time (a listener whose accept queue is full drops the SYNs: a flood) goes over HTTP too,
and so do the calls of the next FRAMES_RETRY_S (doubling with each timeout in a row, at most
FRAMES_RETRY_MAX_S): then a call tries the port again, so at most one call per wait pays the
connect bound (``peer_clients.CONNECT_S``) while the port stays unreachable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S
from kvxferd.errors import (
    AuthError,
    ClaimMismatchError,
    ConfigError,
    HandshakeError,
    HoldExpiredError,
    HoldRequestError,
    IncompatiblePeerError,
    SegmentTooSmallError,
    UnknownHoldError,
)
from kvxferd.frameconn import FrameConnectError, FrameConnectTimeoutError, FrameRefusedError
from kvxferd.sidecar.peer_clients import PeerClients
from kvxferd.sidecar.peer_http import Reply
from kvxferd.sidecar.pull_request import ReaderCounts
from kvxferd.sidecar.signing import PeerKeys, SignFloors, sign_request
from kvxferd.transport import ucxenv
from kvxferd.wire import (
    PROTOCOL_VERSION,
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    ErrorBody,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
    Manifest,
    one_line,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_KEEP_EPOCHS = 4096  # (engine id, epoch) pairs remembered for the epochs-seen counter
_MAX_ADDRESS = (1 << 63) - 1  # READ descriptor addresses are int64
_MAX_TEXT = 1000  # characters kept of a peer's error detail and field
FRAMES_RETRY_S = 1.0
"""Calls sent over HTTP after a framed connect timed out, before one tries the port again."""
FRAMES_RETRY_MAX_S = 60.0
"""Bound of that wait (it doubles with each connect timeout in a row)."""


@dataclass(frozen=True)
class Peer:
    """A handshaken remote sidecar: what reading from it needs."""

    address: str
    engine_id: str
    epoch: int
    agent_name: str
    manifest: Manifest
    region_bases: tuple[int, ...]
    frames_port: int = 0
    """The peer's framed peer API port on its host (0: none)."""
    generation: int = -1
    """The peer's registration generation the rest describes (-1: not stated, an older peer)."""
    pod: tuple[Peer, ...] = ()
    """A pod sidecar's ranks 1 up, each as this peer with that rank's manifest and region
    bases (empty: the peer serves one rank)."""

    @property
    def ranks(self) -> int:
        """Prefill TP ranks this peer serves (its tickets span)."""
        return 1 + len(self.pod)

    def rank(self, r: int) -> Peer:
        """This peer as rank ``r`` of its pod reads it (itself for rank 0)."""
        return self.pod[r - 1] if r else self

    def serves(self, engine_id: str, epoch: int, generation: int) -> bool:
        """Whether this handshake describes the registration a ticket names (a peer that states
        no generation: any of its epoch)."""
        return (self.engine_id, self.epoch) == (engine_id, epoch) and self.generation in (
            -1, generation)  # fmt: skip


class PeerTable:
    """Handshake cache keyed by peer address, valid for one (engine id, epoch) and registration
    generation (the peer engine's manifest, region bases and memory change when it registers
    again in the same epoch: read by the old ones, a pull copied the wrong bytes as done).

    ``add_agent(metadata) -> name`` and ``remove_agent(name)`` are the transport's; they are
    called off the event loop by the caller-supplied functions.
    """

    def __init__(
        self,
        *,
        local_handshake: Callable[[], Handshake],
        add_agent: Callable[[bytes], Awaitable[str]],
        remove_agent: Callable[[str], Awaitable[None]],
        check_compatible: Callable[[Manifest], dict[str, tuple[object, object]]],
        keys: PeerKeys | None,
        timeout_s: float,
        on_change: Callable[[int, bool], None] | None = None,
        on_call: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._local_handshake = local_handshake
        self._add_agent = add_agent
        self._remove_agent = remove_agent
        self._check_compatible = check_compatible
        self._keys = keys
        self._timeout = timeout_s
        self._on_change = on_change
        self._on_call = on_call
        self._peers: dict[str, Peer] = {}
        self._http_only: set[str] = set()  # cached peers whose framed port refused connecting
        # cached peers whose framed connect timed out: (timeouts in a row, when to try again)
        self._frames_wait: dict[str, tuple[int, float]] = {}
        self._floors = SignFloors()  # the earliest ts each restarted peer accepts
        self._clock = clock
        # address -> (lock, callers using it); an entry lives only while someone uses it.
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._epochs: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._clients = PeerClients(timeout_s=timeout_s, keepalive_s=HTTP_CLIENT_KEEPALIVE_S)
        self._readers = ReaderCounts()  # a claim's expected readers, per (manifest, reader TP)
        self.outcomes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def locks(self) -> int:
        """Per-address handshake locks alive now (only addresses someone is handshaking with)."""
        return len(self._locks)

    @asynccontextmanager
    async def _locked(self, address: str) -> AsyncIterator[None]:
        """Serialise handshakes per address; the lock is dropped once nobody uses it."""
        entry = self._locks.get(address)
        if entry is None:
            entry = self._locks[address] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0 and self._locks.get(address) is entry:
                del self._locks[address]

    def _adopt(self, address: str, peer: Peer) -> None:
        self._peers[address] = peer
        self._http_only.discard(address)
        self._frames_wait.pop(address, None)
        pair = (peer.engine_id, peer.epoch)
        new = pair not in self._epochs
        self._epochs[pair] = None
        self._epochs.move_to_end(pair)
        while len(self._epochs) > _KEEP_EPOCHS:
            self._epochs.popitem(last=False)
        if self._on_change is not None:
            self._on_change(len(self._peers), new)

    def cached(self, address: str, engine_id: str, epoch: int, generation: int = -1) -> Peer | None:
        """The handshaken peer at ``address`` if it is this engine epoch and registration
        generation (no I/O)."""
        cached = self._peers.get(address)
        if cached is not None and cached.serves(engine_id, epoch, generation):
            return cached
        return None

    async def get(self, address: str, engine_id: str, epoch: int, generation: int = -1) -> Peer:
        """The peer at ``address`` for this engine epoch and registration generation,
        handshaking if needed.

        A ticket that names another (engine, epoch) than the cached one handshakes again: if
        the peer changed (restarted) the old entry is dropped; if it did not, the ticket is
        stale and fails without disturbing the cached peer (pulls may be reading from it). One
        that names another generation handshakes again too: the answer (the peer's agent
        reloaded) replaces the cached entry, and a ticket of another generation fails
        (UnknownHoldError: its hold went with that registration).
        """
        hit = self.cached(address, engine_id, epoch, generation)
        if hit is not None:
            return hit  # every pull's path: no lock (the lock only orders handshakes)
        async with self._locked(address):
            cached = self._peers.get(address)
            if cached is not None and cached.serves(engine_id, epoch, generation):
                return cached
            if cached is not None and (cached.engine_id, cached.epoch) == (engine_id, epoch) and (
                    0 <= generation < cached.generation):  # fmt: skip
                self._count("stale_ticket")  # generations only grow: no handshake needed
                raise UnknownHoldError(_registered_again(address, cached.generation, generation))
            peer = await self._handshake(address)
            same = cached is not None and (cached.engine_id, cached.epoch) == (
                peer.engine_id,
                peer.epoch,
            )
            if cached is not None and not same:
                log.info(
                    "peer %s changed (%s/%d -> %s/%d); re-handshaken",
                    address,
                    cached.engine_id,
                    cached.epoch,
                    peer.engine_id,
                    peer.epoch,
                )
                await self.forget(address)
            if (peer.engine_id, peer.epoch) != (engine_id, epoch):
                if not same:  # the cached entry keeps this agent when the peer did not change
                    await self._remove_agent(peer.agent_name)
                self._count("stale_ticket")
                raise HandshakeError(
                    f"peer {address} is engine {peer.engine_id} epoch {peer.epoch}, the ticket "
                    f"names {engine_id} epoch {epoch}: the prefill side restarted"
                )
            self._adopt(address, peer)  # same epoch: its agent reloaded, another registration
            if not peer.serves(engine_id, epoch, generation):  # its claim would be a 404
                self._count("stale_ticket")
                raise UnknownHoldError(_registered_again(address, peer.generation, generation))
            return peer

    async def claim(self, address: str, request: ClaimRequest) -> ClaimResponse:
        """Claim a hold at a prefill sidecar; 404/410 become UnknownHoldError/HoldExpiredError.

        A grant that does not fit the claim is a HandshakeError, so the pull fails: one that
        gives the claim no finite end (the READ must end in it), names another hold (another
        call's answer), or expects other readers than the prefill's manifest and our TP size
        give (``descriptors.expected_readers``, what the prefill computes: fewer would release
        the hold while a READ may still copy it; ``reader_tp_size`` from a pod; 0..that for a peer
        not handshaken, whose manifest we do not have). A claim is never sent twice (over HTTP,
        a kept connection closed unanswered fails it): the peer may have granted the first, and
        a second claim of the reader counts a second READ, so the pull's one notification would
        leave the hold pinned until the claim ends.
        """
        answer = await self._call(address, "/v1/claims", request, ClaimResponse, "claim")
        problem = self._claim_problem(self._peers.get(address), request, answer)
        if problem:
            raise HandshakeError(f"peer {address} answered an invalid claim: {problem}")
        return answer

    def _claim_problem(
        self, peer: Peer | None, request: ClaimRequest, answer: ClaimResponse
    ) -> str:
        """What makes ``answer`` no grant of ``request`` (empty: nothing)."""
        if not (math.isfinite(answer.claim_s) and answer.claim_s >= 0
                and math.isfinite(answer.expires_at)):  # fmt: skip
            return f"claim_s {answer.claim_s!r}, expires_at {answer.expires_at!r}"
        ticket, tp = request.ticket, request.reader_tp_size
        if answer.hold_id != ticket.hold_id:
            return f"hold_id {one_line(answer.hold_id[:200])!r}, the claim named {ticket.hold_id!r}"
        readers = answer.expected_readers
        if peer is None or not peer.serves(ticket.engine_id, ticket.epoch, ticket.generation):
            if not 0 <= readers <= tp:
                return f"expected_readers {readers} for a reader TP size of {tp}"
            return ""
        try:
            want = self._readers.expected(peer.manifest, tp, bool(peer.pod))
        except HoldRequestError as exc:  # the prefill would have refused it (422)
            return f"granted to reader TP size {tp}, which cannot read its manifest: {exc}"
        if readers != want:
            return (f"expected_readers {readers}, where its manifest gives {want} for a reader "
                    f"TP size of {tp}")  # fmt: skip
        return ""

    async def heartbeat(self, address: str, request: Heartbeat) -> HeartbeatResponse:
        """Extend holds at a prefill sidecar; the whole call is bounded by the timeout. An
        answer naming a hold the heartbeat did not, or a hold in two lists, is a HandshakeError
        (see ``_unasked``)."""
        answer = await self._call(address, "/v1/heartbeat", request, HeartbeatResponse, "heartbeat")
        _unasked(address, "heartbeat", request.hold_ids, answer)
        return answer

    async def decline(self, address: str, request: DeclineRequest) -> DeclineResponse:
        """Ask a prefill sidecar to release holds its decode will not read. An answer naming a
        hold the decline did not, or a hold in two lists, is a HandshakeError (see ``_unasked``)."""
        answer = await self._call(address, "/v1/decline", request, DeclineResponse, "decline")
        _unasked(address, "decline", [t.hold_id for t in request.tickets], answer)
        return answer

    async def _post(self, address: str, path: str, body: bytes) -> Reply:
        """One signed POST (the signature covers method, path, body, time and a fresh nonce);
        OSError or TimeoutError when the peer cannot be reached or answers no usable HTTP. A
        claim is never sent again after a kept connection closed unanswered: the peer may have
        granted it, and a reader's second claim counts a second READ (see ``claim``)."""
        if self._keys is None:
            raise ConfigError("peer_token: no peer secret configured; cannot sign peer calls")
        keys = self._keys

        def sign() -> dict[str, str]:  # each attempt: a fresh nonce, never a replay
            return {"Authorization": self._sign(keys, address, path, body)}

        async with self._clients.client(address) as client:  # one small pool per peer
            for _ in range(2):  # again after a restarted peer refused our ts (nothing was done)
                reply = await client.post(path, body, {"Content-Type": "application/json"},
                                          sign, resend=path != "/v1/claims")  # fmt: skip
                if not self._refused_ts(address, reply.status_code, reply.content, msgspec.json):
                    break
            return reply

    def _sign(self, keys: PeerKeys, address: str, path: str, body: bytes) -> str:
        """A signature at our clock's time, or at the earliest a restarted peer accepts."""
        return sign_request(keys, "POST", path, body, now=self._floors.ts(address))

    def _refused_ts(self, address: str, status: int, content: bytes, codec: Any) -> bool:
        """Whether a 401 says the peer restarted after our signature's ts: then sign again at
        the ts it names (once: true only for a floor we did not sign at yet)."""
        if status != AuthError.status:
            return False
        try:
            floor = codec.decode(content, type=ErrorBody).not_before
        except (msgspec.MsgspecError, RecursionError):
            return False
        return self._floors.learn(address, floor)

    async def _call(
        self, address: str, path: str, request: object, answer: type[T], what: str
    ) -> T:
        """POST ``request`` to a peer (framed where it serves frames) and decode its answer;
        errors become our exceptions."""
        peer = self._peers.get(address)
        port = peer.frames_port if peer is not None and address not in self._http_only else 0
        waiting = self._frames_wait.get(address)
        if port and waiting is not None and self._clock() < waiting[1]:
            port = 0  # its connect timed out lately: HTTP until the wait ends
        try:
            async with asyncio.timeout(self._timeout):
                if port:
                    try:
                        status, content = await self._framed(address, port, path, request)
                        wire = "frames"
                        self._frames_wait.pop(address, None)
                    except FrameRefusedError as exc:  # full (a flood?), not closed: this call
                        log.debug("peer %s: framed port %d refused the %s (%s); sending it "
                                  "over HTTP", address, port, what, exc)  # fmt: skip
                        port = 0
                    except FrameConnectTimeoutError as exc:  # a full accept queue (a flood?)
                        self._wait_for_frames(address, peer, port, exc)
                        port = 0
                    except FrameConnectError as exc:
                        log.warning("peer %s: framed port %d unusable (%s); calling it over HTTP "
                                    "until the next handshake", address, port, exc)  # fmt: skip
                        if self._peers.get(address) is peer:
                            self._http_only.add(address)
                        port = 0
                if not port:
                    resp = await self._post(address, path, msgspec.json.encode(request))
                    status, content, wire = resp.status_code, resp.content, "http"
        except (OSError, TimeoutError) as exc:
            raise HandshakeError(f"peer {address} unreachable for {what}: {exc!r}") from exc
        if self._on_call is not None:
            self._on_call(what, wire)
        codec = msgspec.msgpack if wire == "frames" else msgspec.json
        if status != 200:
            raise _remote_error(address, status, content, codec)
        try:
            return codec.decode(content, type=answer)
        except (msgspec.MsgspecError, RecursionError) as exc:  # nested past msgspec's bound
            raise HandshakeError(
                f"peer {address} answered an invalid {what}: {_text(exc)}"
            ) from exc

    def _wait_for_frames(self, address: str, peer: Peer | None, port: int, exc: Exception) -> None:
        """Send ``address``'s calls over HTTP for a while after its framed connect timed out
        (FRAMES_RETRY_S, doubling with each timeout in a row up to FRAMES_RETRY_MAX_S)."""
        if self._peers.get(address) is not peer:
            return  # handshaken again meanwhile: its port is another's
        streak, until = self._frames_wait.get(address, (0, 0.0))
        if self._clock() < until:
            return  # a call that waited on the same connect set the wait already
        streak += 1
        wait_s = min(FRAMES_RETRY_S * 2 ** min(streak - 1, 32), FRAMES_RETRY_MAX_S)
        self._frames_wait[address] = (streak, self._clock() + wait_s)
        log.warning("peer %s: framed port %d did not connect in time (%s); calling it over HTTP "
                    "for %g s", address, port, exc, wait_s)  # fmt: skip

    async def _framed(
        self, address: str, port: int, path: str, request: object
    ) -> tuple[int, bytes]:
        """One signed framed call: the signature covers these exact MessagePack bytes."""
        if self._keys is None:
            raise ConfigError("peer_token: no peer secret configured; cannot sign peer calls")
        body = msgspec.msgpack.encode(request)
        for _ in range(2):  # again after a restarted peer refused our ts (nothing was done)
            auth = self._sign(self._keys, address, path, body)
            async with self._clients.framed(address, port) as conn:
                status, raw = await conn.call(f"POST {path}", None, msgspec.Raw(body), auth=auth)
            if not self._refused_ts(address, status, bytes(raw), msgspec.msgpack):
                break
        return status, bytes(raw)

    async def forget(self, address: str) -> None:
        """Drop a cached peer and its NIXL remote agent (peer died or restarted)."""
        peer = self._peers.pop(address, None)
        self._http_only.discard(address)
        self._frames_wait.pop(address, None)
        self._floors.forget(address)
        if peer is not None:
            if self._on_change is not None:
                self._on_change(len(self._peers), False)
            await self._remove_agent(peer.agent_name)

    async def close(self) -> None:
        """Forget every peer and close the HTTP clients."""
        for address in list(self._peers):
            await self.forget(address)
        await self._clients.close()

    @property
    def clients(self) -> PeerClients:
        """The per-peer HTTP clients (bounded; for metrics and tests)."""
        return self._clients

    async def _handshake(self, address: str) -> Peer:
        mine = self._local_handshake()
        body = msgspec.json.encode(mine)
        try:
            resp = await self._post(address, "/v1/handshake", body)
        except (OSError, TimeoutError) as exc:
            self._count("unreachable")
            raise HandshakeError(f"peer {address} unreachable: {exc!r}") from exc
        if resp.status_code != 200:
            self._count(f"http_{resp.status_code}")
            raise _remote_error(address, resp.status_code, resp.content, msgspec.json)
        try:
            theirs = msgspec.json.decode(resp.content, type=Handshake)
            _check_bases(theirs)
        # not JSON, not a handshake, or nested past msgspec's bound (a RecursionError)
        except (msgspec.MsgspecError, RecursionError, HandshakeError) as exc:
            self._count("bad_answer")
            raise HandshakeError(
                f"peer {address} answered an invalid handshake: {_text(exc)}"
            ) from exc
        if theirs.protocol_version != PROTOCOL_VERSION:
            self._count("incompatible")
            raise IncompatiblePeerError(
                {"protocol_version": (PROTOCOL_VERSION, theirs.protocol_version)}
            )
        diff = {**self._check_compatible(theirs.manifest), **ucxenv.segment_diff(
            theirs.tcp_tx_seg_bytes, mine.tcp_rx_seg_bytes, local="reader")}  # fmt: skip
        if diff:
            self._count("incompatible")
            raise IncompatiblePeerError(diff)
        for i, rank in enumerate(theirs.pod):  # a pod's other ranks: checked as rank 0 is
            diff = self._check_compatible(rank.manifest)
            if diff:
                self._count("incompatible")
                raise IncompatiblePeerError({f"pod[{i}].{k}": v for k, v in diff.items()})
        agent_name = await self._add_agent(theirs.agent_metadata)
        self._count("ok")
        peer = Peer(
            address=address,
            engine_id=theirs.engine_id,
            epoch=theirs.epoch,
            agent_name=agent_name,
            manifest=theirs.manifest,
            region_bases=tuple(theirs.region_bases),
            frames_port=theirs.frames_port if 0 < theirs.frames_port <= 65535 else 0,
            generation=theirs.generation if theirs.generation >= 0 else -1,
        )
        pod = tuple(dataclasses.replace(peer, manifest=r.manifest,
                                        region_bases=tuple(r.region_bases))
                    for r in theirs.pod)  # fmt: skip
        return dataclasses.replace(peer, pod=pod) if pod else peer

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def _check_bases(theirs: Handshake) -> None:
    """HandshakeError unless the answer gives one base per manifest region, each region within
    the 64-bit address space (the READ descriptors' remote addresses are int64), for every rank
    of a pod; a pod's ranks must be ranks 0..N-1 of TP N, in order."""
    _check_rank_bases("", theirs.manifest, theirs.region_bases)
    if not theirs.pod:
        return
    size = 1 + len(theirs.pod)
    if (theirs.manifest.tp_rank, theirs.manifest.tp_size) != (0, size):
        raise HandshakeError(f"manifest: rank {theirs.manifest.tp_rank} of "
                             f"{theirs.manifest.tp_size} heads a pod of {size} ranks")  # fmt: skip
    for i, rank in enumerate(theirs.pod):
        m = rank.manifest
        if (m.tp_rank, m.tp_size) != (i + 1, size):
            raise HandshakeError(f"pod[{i}].manifest: rank {m.tp_rank} of {m.tp_size}, expected "
                                 f"rank {i + 1} of {size}")  # fmt: skip
        _check_rank_bases(f"pod[{i}].", m, rank.region_bases)


def _check_rank_bases(where: str, manifest: Manifest, bases: list[int]) -> None:
    regions = manifest.regions
    if len(bases) != len(regions):
        raise HandshakeError(f"{where}region_bases: {len(bases)} bases for {len(regions)} regions")
    for i, (base, region) in enumerate(zip(bases, regions, strict=True)):
        if not 0 <= base <= _MAX_ADDRESS - max(region.size_bytes, 0):
            raise HandshakeError(f"{where}region_bases[{i}]: {base} is no base of a "
                                 f"{region.size_bytes} B region")  # fmt: skip


def _unasked(
    address: str, what: str, asked: list[str], answer: HeartbeatResponse | DeclineResponse
) -> None:
    """HandshakeError when ``answer`` names a hold ``asked`` does not, or one hold in two of its
    lists (extended and missing; released, missing or busy): answers carry no call id, and one
    naming other holds is another call's (a stale or stray answer) or a confused peer's, as is
    one saying two things of a hold; none of its lists can be trusted. A hold named twice in one
    list says one thing twice: it counts once (kvxferd.sidecar.keepalive). A hold asked about
    and named in no list is left to the caller (its lease is unknown: ``unanswered``)."""
    wanted = set(asked)
    for name in answer.__struct_fields__:
        other = next((h for h in getattr(answer, name) if h not in wanted), None)
        if other is not None:
            raise HandshakeError(
                f"peer {address} answered an invalid {what}: {name} names hold "
                f"{one_line(other[:200])!r}, which the {what} did not"
            )
    listed: dict[str, str] = {}
    for name in answer.__struct_fields__:
        for hold in getattr(answer, name):
            first = listed.setdefault(hold, name)
            if first != name:
                raise HandshakeError(f"peer {address} answered an invalid {what}: hold {hold!r} "
                                     f"is in both {first} and {name}")  # fmt: skip


def _registered_again(address: str, theirs: int, ticket: int) -> str:
    return (f"peer {address} is at registration generation {theirs}, the ticket names {ticket}: "
            f"the prefill engine registered again")  # fmt: skip


def _text(exc: Exception) -> str:
    """An error about a peer's answer, cut and on one line (msgspec quotes an unknown field's
    name as the peer wrote it)."""
    return one_line(str(exc)[:_MAX_TEXT])


def _remote_error(address: str, status: int, content: bytes, codec: Any) -> Exception:
    """Translate a peer's error answer (an ErrorBody in ``codec``: JSON over HTTP, MessagePack
    over frames) into our exception type."""
    error = body_field = ""
    try:
        body = codec.decode(content, type=ErrorBody)
        # cut: a failed pull keeps (and logs) its detail, however much text the peer sent;
        # escaped: one log line, whatever characters the peer sent
        detail, error = one_line(body.detail[:_MAX_TEXT]), body.error
        body_field = one_line(body.field[:_MAX_TEXT])
    except (msgspec.MsgspecError, RecursionError):  # not an ErrorBody, or nested too deeply
        detail = one_line(content[:200].decode(errors="replace"))
    if status == UnknownHoldError.status:
        return UnknownHoldError(f"peer {address}: {detail}")
    if status == HoldExpiredError.status:
        return HoldExpiredError(f"peer {address}: {detail}")
    if status == AuthError.status:
        return AuthError(f"peer {address} refused our signature: {detail}")
    if status == ClaimMismatchError.status and error == "ClaimMismatchError":
        return ClaimMismatchError(body_field, f"peer {address}: {detail}")
    if status == SegmentTooSmallError.status and error == "SegmentTooSmallError":
        reason = detail.removeprefix(f"{body_field}: ")  # the peer's memory shrank
        return SegmentTooSmallError(body_field, f"peer {address}: {reason}")
    if status == IncompatiblePeerError.status and error == "IncompatiblePeerError":
        # The peer compared manifests and names the disagreeing fields (comma-separated).
        exc = IncompatiblePeerError({f: (None, None) for f in body_field.split(",") if f})
        exc.args = (f"peer {address} finds us incompatible: {detail}",)
        return exc
    return HandshakeError(f"peer {address} answered {status}: {detail}")
