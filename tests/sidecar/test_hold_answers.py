"""Heartbeat and decline answers are tied to their request, as a claim's grant is to its hold:
answers carry no call id, so one naming a hold the call did not (another call's answer, a stray
one, a confused peer), or one hold in two lists, is a HandshakeError and every hold of that call
comes back ``unanswered``; a hold named twice in one list counts once; a hold asked about and
named in no list is ``unanswered``. Against real servers on loopback
that check the call's signature: the framed peer listener (FRAME_OPERATIONS) and an HTTP one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest

from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.operations import Gate
from kvxferd.api.peer import FRAME_OPERATIONS
from kvxferd.errors import AuthError, HandshakeError
from kvxferd.sidecar.keepalive import decline_at_peers, keep_alive
from kvxferd.sidecar.peers import Peer, PeerTable
from kvxferd.sidecar.signing import PeerKeys, RequestVerifier
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    DeclineRequest,
    DeclineResponse,
    Heartbeat,
    HeartbeatResponse,
    KeepaliveRequest,
    Ticket,
)
from tests.sidecar import peertable

KEYS = PeerKeys.of("hold-answers-secret")
TICKETS = b"hold-answers-ticket-secret"
BOUND_S = 10.0
ASKED = ["a", "b", "c"]


class _Prefill:
    """A prefill sidecar's heartbeat and decline, answered by ``answer(asked hold ids)``: its
    "yes" list is ``extended`` or ``released``, "no" ``missing``, "else" (if any) ``unanswered``
    or ``busy``."""

    def __init__(self, answer: Callable[[list[str]], dict[str, list[str]]]) -> None:
        self.answer = answer
        self.asked: list[list[str]] = []

    def heartbeat(self, req: Heartbeat) -> HeartbeatResponse:
        self.asked.append(list(req.hold_ids))
        lists = self.answer(list(req.hold_ids))
        return HeartbeatResponse(extended=lists["yes"], missing=lists["no"],
                                 unanswered=lists.get("else", []))  # fmt: skip

    def accept_decline(self, req: DeclineRequest) -> DeclineResponse:
        ids = [t.hold_id for t in req.tickets]
        self.asked.append(ids)
        lists = self.answer(ids)
        return DeclineResponse(released=lists["yes"], missing=lists["no"],
                               busy=lists.get("else", []))  # fmt: skip


def _verify(verifier: RequestVerifier) -> Callable[[str, str, bytes, str], None]:
    def verify(method: str, target: str, body: bytes, signature: str) -> None:
        verifier.verify(method, target, body, signature)

    return verify


@contextlib.asynccontextmanager
async def _framed(prefill: _Prefill) -> AsyncIterator[tuple[PeerTable, str]]:
    """A peer table whose (handshaken) peer serves ``prefill`` on the framed peer listener."""
    gate = Gate(ready=lambda: True, verify=_verify(RequestVerifier(KEYS)))
    limits = FrameLimits(max_connections=8, max_frame_bytes=1 << 20)
    server = FrameServer(FRAME_OPERATIONS, prefill, gate, limits)
    listener = socket.create_server(("127.0.0.1", 0))
    await server.start(listener)
    address = "127.0.0.1:1"  # its HTTP listener: never called
    table = peertable.table(KEYS)
    table._peers[address] = Peer(address, "e", 1, "agent", None, (),  # type: ignore[arg-type]
                                 frames_port=listener.getsockname()[1])  # fmt: skip
    try:
        yield table, address
    finally:
        table._peers.clear()
        await table.close()
        await server.close(grace_s=1.0)


@contextlib.asynccontextmanager
async def _http(prefill: _Prefill) -> AsyncIterator[tuple[PeerTable, str]]:
    """A peer table calling ``prefill`` over HTTP (a peer not handshaken: no framed port)."""
    verifier = RequestVerifier(KEYS)
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                body = await reader.readexactly(int(fields["Content-Length"]))
                path = lines[0].split(" ")[1]
                try:
                    verifier.verify("POST", path, body, fields.get("Authorization", ""))
                except AuthError:
                    writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
                    continue
                if path == "/v1/heartbeat":
                    out = prefill.heartbeat(msgspec.json.decode(body, type=Heartbeat))
                else:
                    out = prefill.accept_decline(msgspec.json.decode(body, type=DeclineRequest))
                data = msgspec.json.encode(out)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    table = peertable.table(KEYS)
    try:
        yield table, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        await table.close()
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


SERVED = {"frames": _framed, "http": _http}


def _tickets(address: str, ids: list[str]) -> list[Ticket]:
    return [sign_ticket(Ticket(engine_id="e", epoch=1, hold_id=h, request_id=f"r-{h}",
                               block_ids=[[1]], num_tokens=16, expires_at=100.0, tp_rank=0,
                               tp_size=1, peer=address), TICKETS) for h in ids]  # fmt: skip


async def _both(served, prefill: _Prefill) -> tuple[list[object], list[object]]:  # noqa: ANN001
    """(the peer table's answers or errors, the engine's answers): heartbeat then decline."""
    async with served(prefill) as (table, address):
        tickets = _tickets(address, ASKED)
        direct = []
        for call in (table.heartbeat(address, Heartbeat(hold_ids=ASKED, extend_s=1.0)),
                     table.decline(address, DeclineRequest(tickets=tickets))):  # fmt: skip
            try:
                direct.append(await asyncio.wait_for(call, BOUND_S))
            except HandshakeError as exc:
                direct.append(exc)
        engine = [
            await asyncio.wait_for(keep_alive(table, KeepaliveRequest(tickets=tickets,
                                                                      extend_s=1.0), TICKETS),
                                   BOUND_S),
            await asyncio.wait_for(decline_at_peers(table, DeclineRequest(tickets=tickets),
                                                    TICKETS), BOUND_S),
        ]  # fmt: skip
    return direct, engine


def _names(answer: object) -> set[str]:
    return {h for f in answer.__struct_fields__ for h in getattr(answer, f)}


@pytest.mark.parametrize("wire", ["frames", "http"])
@pytest.mark.parametrize(
    "lie",
    [
        lambda ids: {"yes": [*ids, "stranger"], "no": []},  # another call's hold among ours
        lambda ids: {"yes": ids[:1], "no": ["x", *ids[1:]]},
        lambda ids: {"yes": ["x", "y", "z"], "no": []},  # another call's whole answer
    ],
    ids=["one-more", "missing-list", "none-of-ours"],
)
def test_an_answer_naming_a_hold_not_asked_about_is_invalid_and_every_hold_unanswered(wire, lie):
    prefill = _Prefill(lie)
    direct, engine = asyncio.run(_both(SERVED[wire], prefill))
    assert prefill.asked == [ASKED] * 4  # every call reached the peer, signed and accepted
    for got, what in zip(direct, ("heartbeat", "decline"), strict=True):
        assert isinstance(got, HandshakeError), got
        assert f"invalid {what}" in str(got) and "did not" in str(got)
    kept, declined = engine
    assert (kept.extended, kept.missing, kept.unanswered) == ([], [], ASKED)
    assert (declined.released, declined.missing, declined.unanswered) == ([], [], ASKED)


@pytest.mark.parametrize("wire", ["frames", "http"])
def test_a_hold_an_answer_leaves_out_is_unanswered_and_the_rest_kept(wire):
    prefill = _Prefill(lambda ids: {"yes": ids[:1], "no": ids[1:2]})  # "c": in no list
    direct, engine = asyncio.run(_both(SERVED[wire], prefill))
    assert direct == [HeartbeatResponse(extended=["a"], missing=["b"]),
                      DeclineResponse(released=["a"], missing=["b"])]  # fmt: skip
    kept, declined = engine
    assert (kept.extended, kept.missing, kept.unanswered) == (["a"], ["b"], ["c"])
    assert (declined.released, declined.missing, declined.unanswered) == (["a"], ["b"], ["c"])
    assert all(_names(a) <= set(ASKED) for a in (*direct, *engine))


TWICE = {  # an answer naming a hold in two lists: (lists, the hold, heartbeat's, decline's)
    "yes-and-no": (lambda ids: {"yes": ids, "no": ids[:1]}, "a",
                   ("extended", "missing"), ("released", "missing")),
    "no-and-else": (lambda ids: {"yes": [], "no": ids, "else": ids[2:]}, "c",
                    ("missing", "unanswered"), ("missing", "busy")),
}  # fmt: skip


@pytest.mark.parametrize("wire", ["frames", "http"])
@pytest.mark.parametrize("case", TWICE)
def test_an_answer_naming_a_hold_in_two_lists_is_invalid_and_every_hold_unanswered(wire, case):
    lie, hold, *named = TWICE[case]
    prefill = _Prefill(lie)
    direct, engine = asyncio.run(_both(SERVED[wire], prefill))
    assert prefill.asked == [ASKED] * 4  # every call reached the peer, signed and accepted
    for got, what, (first, second) in zip(direct, ("heartbeat", "decline"), named, strict=True):
        assert isinstance(got, HandshakeError), got
        assert f"invalid {what}: hold {hold!r} is in both {first} and {second}" in str(got)
    kept, declined = engine
    assert (kept.extended, kept.missing, kept.unanswered) == ([], [], ASKED)
    assert (declined.released, declined.missing, declined.unanswered) == ([], [], ASKED)


@pytest.mark.parametrize("wire", ["frames", "http"])
def test_a_hold_an_answer_names_twice_in_one_list_counts_once(wire):
    prefill = _Prefill(lambda ids: {"yes": [ids[0], *ids[:2]], "no": [ids[2]] * 3})
    direct, engine = asyncio.run(_both(SERVED[wire], prefill))
    assert direct == [HeartbeatResponse(extended=["a", "a", "b"], missing=["c"] * 3),
                      DeclineResponse(released=["a", "a", "b"], missing=["c"] * 3)]  # fmt: skip
    kept, declined = engine
    assert (kept.extended, kept.missing, kept.unanswered) == (["a", "b"], ["c"], [])
    assert (declined.released, declined.missing, declined.unanswered) == (["a", "b"], ["c"], [])
