"""Remote prefill sidecars this (decode) sidecar reads from: handshakes, cached per engine epoch.

A handshake exchanges protocol version, manifest and NIXL agent metadata once per
(engine id, boot epoch). A ticket with a newer epoch means the peer restarted: the old entry is
dropped (its NIXL remote agent removed) and the next pull handshakes again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
import msgspec

from kvxferd.config import HTTP_CLIENT_KEEPALIVE_S
from kvxferd.errors import (
    AuthError,
    HandshakeError,
    HoldExpiredError,
    IncompatiblePeerError,
    UnknownHoldError,
)
from kvxferd.wire import (
    PROTOCOL_VERSION,
    ClaimRequest,
    ClaimResponse,
    ErrorBody,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
    Manifest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Peer:
    """A handshaken remote sidecar: what reading from it needs."""

    address: str
    engine_id: str
    epoch: int
    agent_name: str
    manifest: Manifest
    region_bases: tuple[int, ...]


class PeerTable:
    """Handshake cache keyed by peer address, valid for one (engine id, epoch).

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
        token: str,
        timeout_s: float,
    ) -> None:
        self._local_handshake = local_handshake
        self._add_agent = add_agent
        self._remove_agent = remove_agent
        self._check_compatible = check_compatible
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = timeout_s
        self._peers: dict[str, Peer] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._client = httpx.AsyncClient(
            timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=HTTP_CLIENT_KEEPALIVE_S)
        )
        self.outcomes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def cached(self, address: str) -> Peer | None:
        """The cached peer at ``address``, if any."""
        return self._peers.get(address)

    async def get(self, address: str, engine_id: str, epoch: int) -> Peer:
        """The peer at ``address`` for this engine epoch, handshaking if needed.

        A ticket that names another (engine, epoch) than the cached one handshakes again: if
        the peer changed (restarted) the old entry is dropped; if it did not, the ticket is
        stale and fails without disturbing the cached peer (pulls may be reading from it).
        """
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            cached = self._peers.get(address)
            if cached is not None and (cached.engine_id, cached.epoch) == (engine_id, epoch):
                return cached
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
            self._peers[address] = peer
            return peer

    async def claim(self, address: str, request: ClaimRequest) -> ClaimResponse:
        """Claim a hold at a prefill sidecar; 404/410 become UnknownHoldError/HoldExpiredError."""
        return await self._call(address, "/v1/claims", request, ClaimResponse, "claim")

    async def heartbeat(self, address: str, request: Heartbeat) -> HeartbeatResponse:
        """Extend holds at a prefill sidecar; the whole call is bounded by the timeout."""
        return await self._call(address, "/v1/heartbeat", request, HeartbeatResponse, "heartbeat")

    async def _call(
        self, address: str, path: str, request: object, answer: type[T], what: str
    ) -> T:
        """POST ``request`` to a peer and decode its answer; errors become our exceptions."""
        try:
            async with asyncio.timeout(self._timeout):
                resp = await self._client.post(
                    f"http://{address}{path}",
                    content=msgspec.json.encode(request),
                    headers={**self._headers, "Content-Type": "application/json"},
                )
        except (httpx.HTTPError, TimeoutError) as exc:
            raise HandshakeError(f"peer {address} unreachable for {what}: {exc!r}") from exc
        if resp.status_code != 200:
            raise _remote_error(address, resp)
        try:
            return msgspec.json.decode(resp.content, type=answer)
        except msgspec.MsgspecError as exc:
            raise HandshakeError(f"peer {address} answered an invalid {what}: {exc}") from exc

    async def forget(self, address: str) -> None:
        """Drop a cached peer and its NIXL remote agent (peer died or restarted)."""
        peer = self._peers.pop(address, None)
        if peer is not None:
            await self._remove_agent(peer.agent_name)

    async def close(self) -> None:
        """Forget every peer and close the HTTP client."""
        for address in list(self._peers):
            await self.forget(address)
        await self._client.aclose()

    async def _handshake(self, address: str) -> Peer:
        body = msgspec.json.encode(self._local_handshake())
        try:
            resp = await self._client.post(
                f"http://{address}/v1/handshake",
                content=body,
                headers={**self._headers, "Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            self._count("unreachable")
            raise HandshakeError(f"peer {address} unreachable: {exc!r}") from exc
        if resp.status_code != 200:
            self._count(f"http_{resp.status_code}")
            raise _remote_error(address, resp)
        try:
            theirs = msgspec.json.decode(resp.content, type=Handshake)
        except msgspec.ValidationError as exc:
            self._count("bad_answer")
            raise HandshakeError(f"peer {address} answered an invalid handshake: {exc}") from exc
        if theirs.protocol_version != PROTOCOL_VERSION:
            self._count("incompatible")
            raise IncompatiblePeerError(
                {"protocol_version": (PROTOCOL_VERSION, theirs.protocol_version)}
            )
        diff = self._check_compatible(theirs.manifest)
        if diff:
            self._count("incompatible")
            raise IncompatiblePeerError(diff)
        agent_name = await self._add_agent(theirs.agent_metadata)
        self._count("ok")
        return Peer(
            address=address,
            engine_id=theirs.engine_id,
            epoch=theirs.epoch,
            agent_name=agent_name,
            manifest=theirs.manifest,
            region_bases=tuple(theirs.region_bases),
        )

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def _remote_error(address: str, resp: httpx.Response) -> Exception:
    """Translate a peer's error answer into our exception type."""
    error = body_field = ""
    try:
        body = msgspec.json.decode(resp.content, type=ErrorBody)
        detail, error, body_field = body.detail, body.error, body.field
    except msgspec.MsgspecError:
        detail = resp.text[:200]
    if resp.status_code == UnknownHoldError.status:
        return UnknownHoldError(f"peer {address}: {detail}")
    if resp.status_code == HoldExpiredError.status:
        return HoldExpiredError(f"peer {address}: {detail}")
    if resp.status_code == AuthError.status:
        return AuthError(f"peer {address} rejected our token: {detail}")
    if resp.status_code == IncompatiblePeerError.status and error == "IncompatiblePeerError":
        # The peer compared manifests and names the disagreeing fields (comma-separated).
        exc = IncompatiblePeerError({f: (None, None) for f in body_field.split(",") if f})
        exc.args = (f"peer {address} finds us incompatible: {detail}",)
        return exc
    return HandshakeError(f"peer {address} answered {resp.status_code}: {detail}")
