"""A framed call to a peer that restarted lately is refused once (401 SignedBeforeStartError
naming its ``not_before``), signed again at that floor and served; the floor is remembered, so
the next call to that peer is signed at it and takes no 401. Against the real framed peer
listener on loopback, checking signatures with a verifier of a process that started just now."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.operations import Gate
from kvxferd.api.peer import FRAME_OPERATIONS
from kvxferd.errors import SignedBeforeStartError
from kvxferd.sidecar.peers import Peer, PeerTable
from kvxferd.sidecar.signing import PeerKeys, RequestVerifier, parse_header
from kvxferd.wire import (
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    Heartbeat,
    HeartbeatResponse,
    Ticket,
)
from tests.sidecar import peertable
from tests.sidecar.harness import plan

KEYS = PeerKeys.of("restarted-peer-secret")
BOUND_S = 10.0
ADDRESS = "127.0.0.1:1"  # the peer's HTTP listener: never called (a call over it fails)
TICKET = Ticket(
    engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
    expires_at=0.0, tp_rank=0, tp_size=1, peer=ADDRESS,
)  # fmt: skip


class _Prefill:
    """A restarted prefill's claims, heartbeats and declines: each granted, each recorded."""

    def __init__(self) -> None:
        self.served: list[str] = []

    async def claim(self, req: ClaimRequest) -> ClaimResponse:
        self.served.append("claim")
        return ClaimResponse(hold_id=req.ticket.hold_id, expires_at=time.time() + 60,
                             expected_readers=1, claim_s=req.claim_s)  # fmt: skip

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        self.served.append("heartbeat")
        return HeartbeatResponse(extended=list(req.hold_ids), missing=[])

    def accept_decline(self, req: DeclineRequest) -> DeclineResponse:
        self.served.append("decline")
        return DeclineResponse(released=[t.hold_id for t in req.tickets], missing=[])


@contextlib.asynccontextmanager
async def _restarted(
    prefill: _Prefill, checked: list[tuple[str, int]]
) -> AsyncIterator[tuple[PeerTable, RequestVerifier, list[str]]]:
    """A peer table whose peer (handshaken before it restarted: cached with its framed port)
    serves ``prefill`` on a framed listener that started now; every signature checked is
    appended to ``checked`` as (outcome, its ts); the table's calls as their wire."""
    verifier = RequestVerifier(KEYS, started=time.time())

    def verify(method: str, target: str, body: bytes, signature: str) -> None:
        ts = int(parse_header(signature)["ts"])
        try:
            verifier.verify(method, target, body, signature)
        except SignedBeforeStartError:
            checked.append(("refused", ts))
            raise
        checked.append(("accepted", ts))

    server = FrameServer(FRAME_OPERATIONS, prefill, Gate(ready=lambda: True, verify=verify),
                         FrameLimits(max_connections=8, max_frame_bytes=1 << 20))  # fmt: skip
    listener = socket.create_server(("127.0.0.1", 0))
    await server.start(listener)
    wires: list[str] = []
    table = peertable.table(KEYS)
    table._on_call = lambda _call, wire: wires.append(wire)
    table._peers[ADDRESS] = Peer(ADDRESS, "e", 1, "agent", plan("llama-3.1-8b", num_blocks=4),
                                 (), frames_port=listener.getsockname()[1])  # fmt: skip
    try:
        yield table, verifier, wires
    finally:
        table._peers.clear()
        await table.close()
        await server.close(grace_s=1.0)


def _call(table: PeerTable, what: str):  # noqa: ANN202
    if what == "claim":
        return table.claim(ADDRESS, ClaimRequest(ticket=TICKET, reader="me", reader_tp_size=1,
                                                 claim_s=5.0))  # fmt: skip
    if what == "heartbeat":
        return table.heartbeat(ADDRESS, Heartbeat(hold_ids=["h"], extend_s=5.0))
    return table.decline(ADDRESS, DeclineRequest(tickets=[TICKET]))


@pytest.mark.parametrize("what", ["claim", "heartbeat", "decline"])
def test_a_framed_call_refused_as_signed_before_the_peers_start_is_signed_again_at_its_floor_once(
    what,
):
    prefill, checked = _Prefill(), []

    async def scenario() -> tuple[list[object], int, list[str]]:
        async with _restarted(prefill, checked) as (table, verifier, wires):
            answers = [await asyncio.wait_for(_call(table, what), BOUND_S) for _ in range(2)]
            return answers, verifier.not_before, wires

    answers, floor, wires = asyncio.run(scenario())
    assert all(a is not None for a in answers)
    assert wires == ["frames", "frames"]  # neither call fell back to HTTP
    first_ts = checked[0][1]
    # The first call: refused once, then signed at the floor the 401 named and served; the
    # second: signed at the remembered floor, served without a 401. Nothing was served twice.
    assert checked == [("refused", first_ts), ("accepted", floor), ("accepted", floor)]
    assert first_ts < floor
    assert prefill.served == [what, what]
