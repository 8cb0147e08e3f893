"""The peer table's per-address handshake locks live only while someone uses them."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.errors import HandshakeError
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.signing import PeerKeys


def _table() -> PeerTable:
    async def add(_: bytes) -> str:
        raise AssertionError("no handshake succeeds here")

    async def remove(_: str) -> None:
        return None

    return PeerTable(
        local_handshake=lambda: None,  # type: ignore[arg-type, return-value]
        add_agent=add,
        remove_agent=remove,
        check_compatible=lambda _: {},
        keys=PeerKeys.of("s"),
        timeout_s=5.0,
    )


def test_handshake_locks_are_dropped_once_nobody_waits_on_them():
    async def scenario() -> int:
        table = _table()
        table._local_handshake = lambda: {"hello": 1}  # any encodable body will do
        try:
            # Nothing listens on these ports: every handshake fails, concurrently, some twice.
            addresses = [f"127.0.0.1:{port}" for port in (1, 2, 3, 1, 2, 3)]
            results = await asyncio.gather(
                *(table.get(a, "e", 1) for a in addresses), return_exceptions=True
            )
            assert all(isinstance(r, HandshakeError) for r in results)
            return table.locks
        finally:
            await table.close()

    assert asyncio.run(scenario()) == 0


def test_a_peer_table_without_a_secret_refuses_to_call():
    from kvxferd.errors import ConfigError

    async def scenario() -> None:
        table = _table()
        table._keys = None
        table._local_handshake = lambda: {"hello": 1}
        try:
            with pytest.raises(ConfigError):
                await table.get("127.0.0.1:1", "e", 1)
            assert table.locks == 0
        finally:
            await table.close()

    asyncio.run(scenario())
