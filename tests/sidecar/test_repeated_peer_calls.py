"""A peer call the prefill side may get twice: the decode's HTTP client sends a request again on
a new connection when a kept one closed unanswered, and the peer may have read and done the
first one before it closed. Against an in-process prefill Sidecar (HoldTable and its peer
handlers), driven directly and over HTTP through the decode's PeerTable.

A heartbeat sent twice does what one does (the lease extended, the same answer); a decline sent
twice releases the hold once (the second answers ``missing``: already gone). A claim sent twice
by its reader takes no second reader slot, but it counts a second READ (the same tickets pulled
twice), so the pull's one notification would leave the hold pinned until the claim ends, and a
hold its reader's TP shape reads nothing of is gone at the second claim (404). So a claim is
never sent again (kvxferd.sidecar.peers; the pull fails instead); heartbeats and declines are.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest

from kvxferd.errors import ClaimMismatchError, HandshakeError, KvxferdError, UnknownHoldError
from kvxferd.sidecar.holds import NotifyOutcome
from kvxferd.sidecar.peers import PeerTable
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.signing import PeerKeys
from kvxferd.wire import (
    ClaimRequest,
    ClaimResponse,
    DeclineRequest,
    DeclineResponse,
    ErrorBody,
    Heartbeat,
    HeartbeatResponse,
    HoldRequest,
    RegisterRequest,
)
from tests.sidecar import peertable
from tests.sidecar.holdtable import req, table
from tests.sidecar.inprocess import chosen_ticket, run_in_process

pytestmark = pytest.mark.nixl
HOLD = "chosen-1"


async def _held(sidecar: Sidecar, register: RegisterRequest) -> int:
    """Register and place hold HOLD (request r1, block 5); the registration's generation."""
    generation = (await sidecar.register(register)).generation
    sidecar.hold(HoldRequest(request_id="r1", block_ids=[[5]], num_tokens=16, hold_id=HOLD,
                             generation=generation))  # fmt: skip
    return generation


def test_a_heartbeat_sent_twice_does_what_one_does():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        await _held(sidecar, register)
        holds = sidecar.holds
        assert holds is not None
        beat = Heartbeat(hold_ids=[HOLD, "gone-1"], extend_s=300.0)
        first = sidecar.heartbeat(beat)
        extended_to = holds.get(HOLD).expires_at
        assert sidecar.heartbeat(beat) == first == HeartbeatResponse(
            extended=[HOLD], missing=["gone-1"])  # fmt: skip
        hold = holds.get(HOLD)
        assert hold.expires_at >= extended_to and hold.reading == {} and hold.reason is None
        assert holds.released_since(0).holds == []

    run_in_process(twice, engine_id="repeat-heartbeat")


def test_a_decline_sent_twice_releases_the_hold_once_and_answers_missing_the_second_time():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        decline = DeclineRequest(tickets=[ticket], reason="aborted")
        first, second = sidecar.accept_decline(decline), sidecar.accept_decline(decline)
        assert (first.released, first.missing, first.busy) == ([HOLD], [], [])
        assert (second.released, second.missing, second.busy) == ([], [HOLD], [])
        holds = sidecar.holds
        assert holds is not None and HOLD not in holds
        released = [(r.hold_id, r.reason) for r in holds.released_since(0).holds]
        assert released == [(HOLD, "declined")]

    run_in_process(twice, engine_id="repeat-decline")


def test_a_claim_sent_twice_takes_no_second_reader_slot_but_counts_a_second_read():
    async def twice(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        claim = ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
        first, second = await sidecar.claim(claim), await sidecar.claim(claim)
        assert (first.hold_id, first.expected_readers) == (second.hold_id, 1)
        holds = sidecar.holds
        assert holds is not None
        with pytest.raises(ClaimMismatchError) as err:  # d0 holds the hold's one reader slot
            await sidecar.claim(ClaimRequest(ticket=ticket, reader="d1", reader_tp_size=1,
                                             claim_s=5.0))  # fmt: skip
        assert err.value.field == "reader" and holds.get(HOLD).readers == {"d0"}
        # The pull's one READ notifies once: the hold waits for a second READ that never comes.
        assert holds.notify(HOLD, "d0") is NotifyOutcome.COUNTED
        assert HOLD in holds and holds.released_since(0).holds == []

    run_in_process(twice, engine_id="repeat-claim")


def test_a_claim_sent_twice_of_a_hold_its_reader_reads_nothing_of_is_refused_the_second_time():
    t = table()  # a reader TP shape that reads nothing of this rank expects 0 readers
    hold = t.hold(req())
    assert t.claim(hold.hold_id, "d0", 5.0, expected_readers=0).expected_readers == 0
    with pytest.raises(UnknownHoldError, match="already released"):
        t.claim(hold.hold_id, "d0", 5.0, expected_readers=0)


class _Prefill:
    """``sidecar``'s peer handlers behind an HTTP listener on loopback (signatures unchecked:
    not what this is about). A path in ``drop`` is done once more, then its connection closed
    unanswered, as a peer that read a request and went away before answering it."""

    ROUTES = {"/v1/heartbeat": Heartbeat, "/v1/decline": DeclineRequest,
              "/v1/claims": ClaimRequest}  # fmt: skip

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.done: list[str] = []
        self.drop: set[str] = set()

    async def answer(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = msgspec.json.decode(body, type=self.ROUTES[path])
        self.done.append(path)
        try:
            if isinstance(request, Heartbeat):
                out: object = self.sidecar.heartbeat(request)
            elif isinstance(request, DeclineRequest):
                out = self.sidecar.accept_decline(request)
            else:
                out = await self.sidecar.claim(request)
        except KvxferdError as exc:
            return exc.status, msgspec.json.encode(ErrorBody(error=type(exc).__name__,
                                                             detail=str(exc)))  # fmt: skip
        return 200, msgspec.json.encode(out)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                path = lines[0].split(" ")[1]
                status, data = await self.answer(
                    path, await reader.readexactly(int(fields["Content-Length"]))
                )
                if path in self.drop:
                    self.drop.discard(path)
                    break  # done, and gone before answering
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (
                    status, len(data), data))  # fmt: skip
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def _over_http(sidecar: Sidecar) -> AsyncIterator[tuple[_Prefill, PeerTable, str]]:
    """The decode's peer table and ``sidecar`` over HTTP (a peer not handshaken: no frames)."""
    prefill = _Prefill(sidecar)
    server = await asyncio.start_server(prefill.handle, "127.0.0.1", 0)

    peers = peertable.table(PeerKeys.of("repeated-calls-secret"))
    try:
        yield prefill, peers, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        await peers.close()
        server.close()


def test_a_claim_whose_kept_connection_closed_unanswered_is_not_sent_again():
    async def dropped(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        beat = Heartbeat(hold_ids=[HOLD], extend_s=300.0)
        async with _over_http(sidecar) as (prefill, peers, address):
            claim = ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=5.0)
            await peers.heartbeat(address, beat)  # its connection is kept
            prefill.drop.add("/v1/claims")
            with pytest.raises(HandshakeError, match="unreachable for claim"):
                await asyncio.wait_for(peers.claim(address, claim), 10.0)
            assert prefill.done == ["/v1/heartbeat", "/v1/claims"]  # sent once
            holds = sidecar.holds
            assert holds is not None and holds.get(HOLD).reading == {"d0": 1}
            # The same tickets pulled again: its claim and READ, one notification each.
            assert isinstance(await peers.claim(address, claim), ClaimResponse)
            assert holds.notify(HOLD, "d0") is NotifyOutcome.COUNTED
            assert holds.notify(HOLD, "d0") is NotifyOutcome.RELEASED

    run_in_process(dropped, engine_id="dropped-claim")


def test_a_heartbeat_or_decline_whose_kept_connection_closed_unanswered_is_sent_again():
    async def dropped(sidecar: Sidecar, register: RegisterRequest) -> None:
        ticket = chosen_ticket(sidecar, await _held(sidecar, register), HOLD)
        beat = Heartbeat(hold_ids=[HOLD], extend_s=300.0)
        async with _over_http(sidecar) as (prefill, peers, address):
            await peers.heartbeat(address, beat)  # its connection is kept
            prefill.drop.add("/v1/heartbeat")
            again = await asyncio.wait_for(peers.heartbeat(address, beat), 10.0)
            assert again == HeartbeatResponse(extended=[HOLD], missing=[])
            prefill.drop.add("/v1/decline")
            decline = DeclineRequest(tickets=[ticket], reason="aborted")
            answer = await asyncio.wait_for(peers.decline(address, decline), 10.0)
            assert answer == DeclineResponse(released=[], missing=[HOLD])  # the first did it
            assert prefill.done == ["/v1/heartbeat"] * 3 + ["/v1/decline"] * 2
        holds = sidecar.holds
        assert holds is not None
        released = [(r.hold_id, r.reason) for r in holds.released_since(0).holds]
        assert released == [(HOLD, "declined")]

    run_in_process(dropped, engine_id="dropped-beat")
