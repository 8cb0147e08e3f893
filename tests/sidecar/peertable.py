"""Peer tables for tests: one that reaches no peer, and one whose peer answers every handshake
with the bytes a test gives (no network, no NIXL: the agent it loads is recorded)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvxferd.sidecar.peer_http import Reply
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.wire import PROTOCOL_VERSION, Handshake
from tests.sidecar.harness import plan


def table(keys: PeerKeys | None = None) -> PeerTable:
    """A peer table (signing with ``keys``, default a test secret) whose handshakes all fail
    before an agent is loaded."""

    async def add(_: bytes) -> str:
        raise AssertionError("no handshake succeeds here")

    async def remove(_: str) -> None:
        return None

    return PeerTable(
        local_handshake=lambda: None,  # type: ignore[arg-type, return-value]
        add_agent=add,
        remove_agent=remove,
        check_compatible=lambda _: {},
        keys=keys or PeerKeys.of("s"),
        timeout_s=5.0,
    )


def answering(body: bytes) -> tuple[PeerTable, list[bytes]]:
    """A table whose peer answers every handshake with ``body`` (200); the metadata it loads."""
    loaded: list[bytes] = []

    async def add(metadata: bytes) -> str:
        loaded.append(metadata)
        return "their-agent"

    peers = table()
    peers._add_agent = add
    mine = msgspec.json.decode(their_handshake(), type=Handshake)
    peers._local_handshake = lambda: mine

    async def post(address: str, path: str, _body: bytes) -> Reply:
        return Reply(200, body)

    peers._post = post  # type: ignore[method-assign]
    return peers, loaded


def their_handshake(bases: Callable[[int], list[int]] = lambda n: [1 << 30] * n,
                    engine_id: str = "e") -> bytes:  # fmt: skip
    """A prefill's handshake answer whose ``region_bases`` are ``bases(number of regions)``."""
    manifest = plan("qwen3-8b")
    answer = Handshake(
        protocol_version=PROTOCOL_VERSION, engine_id=engine_id, epoch=1,
        agent_name="their-agent",
        agent_metadata=b"md", manifest=manifest,
        region_bases=bases(len(manifest.regions)),
    )  # fmt: skip
    return msgspec.json.encode(answer)
