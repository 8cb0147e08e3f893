"""The peer table: per-address handshake locks live only while someone uses them; a peer's
answers are checked before they are adopted, and its text reaches our errors and logs cut and
on one line (every character ONE_LINE_PATTERN refuses escaped)."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.errors import HandshakeError
from kvxferd.wire import MAX_GROUPS, MAX_REGIONS
from tests.sidecar.peertable import answering as _answering
from tests.sidecar.peertable import table as _table
from tests.sidecar.peertable import their_handshake as _their_handshake


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


def test_peer_clients_are_one_per_address_bounded_and_closed_when_idle():
    from kvxferd.sidecar.peer_clients import PeerClients

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    async def scenario() -> None:
        clock = Clock()
        pool = PeerClients(timeout_s=1.0, keepalive_s=1.0, max_clients=2, idle_s=10.0,
                           clock=clock)  # fmt: skip
        async with pool.client("a:1") as a1, pool.client("a:1") as a2:
            assert a1 is a2  # one client per address, shared by concurrent calls
            async with pool.client("b:1"), pool.client("c:1"):
                assert len(pool) == 3  # over the bound, but every one is in use: none closed
        assert a1.is_closed is False
        async with pool.client("d:1"):  # LRU: a:1 and b:1 (idle now) make room
            pass
        assert len(pool) == 2 and a1.is_closed
        clock.t = 11.0
        async with pool.client("e:1"):
            assert len(pool) == 1  # c:1 and d:1 were idle past idle_s
        assert pool.opened == 5
        await pool.close()
        assert len(pool) == 0

    asyncio.run(scenario())


def test_a_cached_peer_is_served_while_a_handshake_with_its_address_is_in_progress():
    from kvxferd.sidecar.peers import Peer

    async def scenario() -> None:
        table = _table()
        peer = Peer("127.0.0.1:1", "e", 1, "agent", None, ())  # type: ignore[arg-type]
        table._peers[peer.address] = peer
        try:
            async with table._locked(peer.address):  # someone is handshaking (a newer epoch)
                got = await asyncio.wait_for(table.get(peer.address, "e", 1), 5.0)
            assert got is peer
            assert table.locks == 0
        finally:
            table._peers.clear()
            await table.close()

    asyncio.run(scenario())


def _their_long_manifest(key: str, n: int) -> bytes:
    """A handshake answer whose manifest repeats its first ``key`` entry (regions or groups) to
    ``n``, with a base per region."""
    import msgspec

    answer = msgspec.json.decode(_their_handshake())
    manifest = answer["manifest"]
    manifest[key] = manifest[key][:1] * n
    answer["region_bases"] = [1 << 30] * len(manifest["regions"])
    return msgspec.json.encode(answer)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"<html>not a handshake</html>", "handshake"),
        (_their_handshake(lambda n: [1 << 30] * (n - 1)), "region_bases"),
        (_their_handshake(lambda n: [-1] * n), "region_bases[0]"),
        (_their_handshake(lambda n: [1 << 30] * (n - 1) + [(1 << 63) - 1]), "region_bases["),
        (_their_handshake(engine_id="e\n"), "engine_id"),
        (_their_long_manifest("groups", MAX_GROUPS + 1), "manifest.groups"),
        (_their_long_manifest("regions", MAX_REGIONS + 1), "manifest.regions"),
    ],
    ids=[
        "not-json",
        "too-few-bases",
        "negative-base",
        "region-past-the-address-space",
        "engine-id-with-a-newline",
        "more-groups-than-max-groups",
        "more-regions-than-max-regions",
    ],  # fmt: skip
)
def test_an_unusable_handshake_answer_is_a_handshake_error_and_loads_no_agent(body, field):
    async def scenario() -> None:
        table, loaded = _answering(body)
        try:
            with pytest.raises(HandshakeError, match=field.replace("[", r"\[")):
                await table.get("127.0.0.1:1", "e", 1)
            assert loaded == [] and len(table) == 0
            assert table.outcomes == {"bad_answer": 1}
        finally:
            await table.close()

    asyncio.run(scenario())


def test_a_handshake_answer_with_a_base_per_region_is_adopted():
    async def scenario() -> None:
        table, loaded = _answering(_their_handshake())
        try:
            peer = await table.get("127.0.0.1:1", "e", 1)
            assert loaded == [b"md"] and peer.agent_name == "their-agent"
            assert len(peer.region_bases) == len(peer.manifest.regions)
        finally:
            await table.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("claim_s", "expires_at"),
    [(float("nan"), 1e9), (float("inf"), 1e9), (-1.0, 1e9), (0.0, float("nan"))],
    ids=["nan-claim", "endless-claim", "negative-claim", "nan-expiry"],
)
def test_a_claim_answer_without_a_finite_end_fails_the_claim(claim_s, expires_at):
    # The READ must end within the claim: an answer that gives it no finite end would let a
    # READ that outlived the hold pass as done.
    import msgspec

    from kvxferd.sidecar.peers import Peer
    from kvxferd.wire import ClaimRequest, ClaimResponse, Ticket

    answer = ClaimResponse(hold_id="h", expires_at=expires_at, expected_readers=1,
                           claim_s=claim_s)  # fmt: skip
    ticket = Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:1",
    )  # fmt: skip

    async def framed(address: str, port: int, path: str, request: object) -> tuple[int, bytes]:
        return 200, msgspec.msgpack.encode(answer)

    async def scenario() -> None:
        table = _table()
        table._peers["127.0.0.1:1"] = Peer("127.0.0.1:1", "e", 1, "a", None, (), frames_port=2)  # type: ignore[arg-type]
        table._framed = framed  # type: ignore[method-assign]
        request = ClaimRequest(ticket=ticket, reader="me", reader_tp_size=1, claim_s=1.0)
        try:
            with pytest.raises(HandshakeError, match="invalid claim"):
                await table.claim("127.0.0.1:1", request)
        finally:
            table._peers.clear()
            await table.close()

    asyncio.run(scenario())


def _claim_answered(answer: object, *, prefill_tp: int | None, reader_tp_size: int) -> object:
    """What ``claim`` returns (or raises) when the prefill answers ``answer``: a handshaken
    peer of ``prefill_tp`` ranks (rank 0, framed), or none handshaken (None: over HTTP)."""
    import msgspec

    from kvxferd.sidecar.peer_http import Reply
    from kvxferd.sidecar.peers import Peer
    from kvxferd.wire import ClaimRequest, Ticket
    from tests.sidecar.harness import plan

    ticket = Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=prefill_tp or 1, peer="127.0.0.1:1",
    )  # fmt: skip

    async def framed(address: str, port: int, path: str, request: object) -> tuple[int, bytes]:
        return 200, msgspec.msgpack.encode(answer)

    async def post(address: str, path: str, _body: bytes) -> Reply:
        return Reply(200, msgspec.json.encode(answer))

    async def scenario() -> object:
        table = _table()
        if prefill_tp is not None:
            manifest = plan("llama-3.1-8b", tp_size=prefill_tp, num_blocks=4)
            table._peers["127.0.0.1:1"] = Peer("127.0.0.1:1", "e", 1, "a", manifest, (),
                                               frames_port=2)  # fmt: skip
        table._framed = framed  # type: ignore[method-assign]
        table._post = post  # type: ignore[method-assign]
        request = ClaimRequest(ticket=ticket, reader="me", reader_tp_size=reader_tp_size,
                               claim_s=1.0)  # fmt: skip
        try:
            return await table.claim("127.0.0.1:1", request)
        except HandshakeError as exc:
            return exc
        finally:
            table._peers.clear()
            await table.close()

    return asyncio.run(scenario())


def _granted(hold_id: str = "h", expected_readers: int = 1) -> object:
    from kvxferd.wire import ClaimResponse

    return ClaimResponse(hold_id=hold_id, expires_at=1e9, expected_readers=expected_readers,
                         claim_s=1.0)  # fmt: skip


@pytest.mark.parametrize("hold_id", ["h2", "H", ""])
def test_a_claim_answer_for_another_hold_fails_the_claim(hold_id):
    # The answer of another call (a stale or stray one on a shared connection, or a confused
    # peer) must not pass as this hold's grant: the READ's bytes would count as claimed.
    got = _claim_answered(_granted(hold_id=hold_id), prefill_tp=1, reader_tp_size=1)
    assert isinstance(got, HandshakeError), got
    assert "invalid claim" in str(got) and "hold_id" in str(got)


@pytest.mark.parametrize(
    ("prefill_tp", "reader_tp_size", "readers"),
    [(1, 1, 0), (1, 1, 2), (2, 4, 1), (2, 4, 3), (1, 2, -1), (1, 1, 1 << 40)],
)
def test_a_claim_answer_expecting_other_readers_than_the_shapes_give_fails_the_claim(
    prefill_tp, reader_tp_size, readers
):
    # The prefill releases the hold after expected_readers notifications: fewer than the
    # decode ranks that read it frees blocks a READ may still copy (0: released at the claim).
    # Both sides derive it from the prefill's manifest and the reader's TP size alone.
    got = _claim_answered(_granted(expected_readers=readers), prefill_tp=prefill_tp,
                          reader_tp_size=reader_tp_size)  # fmt: skip
    assert isinstance(got, HandshakeError), got
    assert "invalid claim" in str(got) and "expected_readers" in str(got)


def test_a_claim_granted_to_a_reader_tp_size_that_cannot_read_the_manifest_fails_the_claim():
    # 8 KV heads over 3 readers: the prefill refuses such a claim (422); a grant is invalid.
    got = _claim_answered(_granted(expected_readers=1), prefill_tp=1, reader_tp_size=3)
    assert isinstance(got, HandshakeError), got
    assert "invalid claim" in str(got) and "cannot read its manifest" in str(got)


@pytest.mark.parametrize("readers", [-1, 3, 1 << 40])
def test_a_claim_answer_of_a_peer_not_handshaken_expects_at_most_the_readers_tp_size(readers):
    got = _claim_answered(_granted(expected_readers=readers), prefill_tp=None, reader_tp_size=2)
    assert isinstance(got, HandshakeError), got
    assert "invalid claim" in str(got) and "expected_readers" in str(got)


@pytest.mark.parametrize(
    ("prefill_tp", "reader_tp_size", "readers"),
    [(1, 1, 1), (2, 4, 2), (2, 1, 1), (None, 2, 0), (None, 2, 2)],
)
def test_a_claim_answer_naming_its_hold_and_the_readers_the_shapes_give_is_accepted(
    prefill_tp, reader_tp_size, readers
):
    answer = _granted(expected_readers=readers)
    got = _claim_answered(answer, prefill_tp=prefill_tp, reader_tp_size=reader_tp_size)
    assert got == answer


@pytest.mark.parametrize("status", [404, 401, 409, 502])
@pytest.mark.parametrize("error", ["ClaimMismatchError", "IncompatiblePeerError", "Other"])
def test_a_peers_error_answer_is_cut_to_a_bounded_message(status, error):
    # A failed pull keeps its detail (and logs it): a peer's text must not make it huge.
    import msgspec

    from kvxferd.sidecar.peers import _remote_error
    from kvxferd.wire import ErrorBody

    body = ErrorBody(error=error, detail="d" * (1 << 20), field=",".join(["f"] * (1 << 18)))
    exc = _remote_error("127.0.0.1:1", status, msgspec.json.encode(body), msgspec.json)
    assert len(str(exc)) < 2048
    assert len(getattr(exc, "field", "") or "") < 2048
    assert len(getattr(exc, "fields", {})) < 1024


@pytest.mark.parametrize("status", [404, 401, 409, 422, 502])
@pytest.mark.parametrize("error", ["ClaimMismatchError", "SegmentTooSmallError", "Other"])
def test_a_peers_error_answer_cannot_forge_a_log_line(status, error):
    # The detail ends up in the decode's logs and in PullStatus.detail: one line, always.
    import msgspec

    from kvxferd.sidecar.peers import _remote_error
    from kvxferd.wire import ErrorBody

    forged = "x\n2026-01-01 INFO forged\r\x1b[2J\x85\u2028end\tok"
    for content in (msgspec.json.encode(ErrorBody(error=error, detail=forged, field=forged)),
                    forged.encode()):  # fmt: skip
        exc = _remote_error("127.0.0.1:1", status, content, msgspec.json)
        text = f"{exc} {getattr(exc, 'field', '')}"
        assert len(text.splitlines()) == 1 and "\x1b" not in text, text
        assert "forged" in text and "\t" in text  # escaped, not dropped; a tab is kept


_BREAKERS = "".join(chr(c) for c in [*range(0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0)])
_BREAKERS += "\u2028\u2029"  # every character ONE_LINE_PATTERN refuses: C0 but tab, DEL, C1


@pytest.mark.parametrize("status", [404, 401, 409, 422, 502])
@pytest.mark.parametrize("error", ["ClaimMismatchError", "SegmentTooSmallError", "Other"])
def test_a_peers_error_text_keeps_no_control_character_of_any_kind(status, error):
    # C1 too: U+009B is an 8-bit CSI (a terminal escape), U+0085 a line break; so are U+2028/9.
    import re

    import msgspec

    from kvxferd.sidecar.peers import _remote_error
    from kvxferd.wire import ONE_LINE_PATTERN, ErrorBody

    forged = f"x{_BREAKERS}forged"
    for content in (msgspec.json.encode(ErrorBody(error=error, detail=forged, field=forged)),
                    forged.encode()):  # fmt: skip
        exc = _remote_error("127.0.0.1:1", status, content, msgspec.json)
        for text in (str(exc), getattr(exc, "field", "")):
            assert re.fullmatch(ONE_LINE_PATTERN, text), ascii(text)
        assert "\\x9b" in str(exc) and "\\x1b" in str(exc)  # escaped, not dropped


def test_an_invalid_handshake_answer_is_told_on_one_line():
    # msgspec names an unknown manifest field as the peer wrote it.
    import re

    import msgspec

    from kvxferd.wire import ONE_LINE_PATTERN

    answer = msgspec.json.decode(_their_handshake())
    answer["manifest"][f"x{_BREAKERS}forged"] = 1

    async def scenario() -> None:
        table, loaded = _answering(msgspec.json.encode(answer))
        try:
            with pytest.raises(HandshakeError, match="invalid handshake") as err:
                await table.get("127.0.0.1:1", "e", 1)
            assert re.fullmatch(ONE_LINE_PATTERN, str(err.value)), ascii(str(err.value))
            assert "forged" in str(err.value) and loaded == []
        finally:
            await table.close()

    asyncio.run(scenario())


_DEEP = 100_000  # past msgspec's depth bound (Python's recursion limit)


@pytest.mark.parametrize(
    ("call", "status", "wire"),
    [("handshake", 200, "http"), ("claim", 200, "http"), ("heartbeat", 200, "frames"),
     ("decline", 200, "frames"), ("claim", 404, "http"), ("claim", 409, "frames")],
)  # fmt: skip
def test_a_peer_answer_nested_too_deeply_is_an_invalid_answer_not_a_crash(call, status, wire):
    # msgspec raises RecursionError (no MsgspecError) for a value nested ~1,000 deep, even in a
    # field it skips: a prefill side (or whatever answers at its address) must not turn that
    # into an unexpected exception (keepalive and decline then answered the engine 500, every
    # other prefill side's answer lost).

    from kvxferd.errors import KvxferdError
    from kvxferd.sidecar.peer_http import Reply
    from kvxferd.sidecar.peers import Peer
    from kvxferd.wire import ClaimRequest, DeclineRequest, Heartbeat, Ticket

    if wire == "http":
        content = b'{"x": ' + b"[" * _DEEP + b"]" * _DEEP + b"}"
    else:
        content = b"\x81\xa1x" + b"\x91" * _DEEP + b"\xc0"
    ticket = Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:1",
    )  # fmt: skip
    requests = {
        "claim": ClaimRequest(ticket=ticket, reader="me", reader_tp_size=1, claim_s=1.0),
        "heartbeat": Heartbeat(hold_ids=["h"], extend_s=1.0),
        "decline": DeclineRequest(tickets=[ticket]),
    }

    async def post(address: str, path: str, _body: bytes) -> Reply:
        return Reply(status, content)

    async def framed(address: str, port: int, path: str, request: object) -> tuple[int, bytes]:
        return status, content

    async def scenario() -> None:
        table, loaded = _answering(content)
        table._post = post  # type: ignore[method-assign]
        table._framed = framed  # type: ignore[method-assign]
        if call != "handshake":
            port = 2 if wire == "frames" else 0
            table._peers["127.0.0.1:1"] = Peer("127.0.0.1:1", "e", 1, "a", None, (),  # type: ignore[arg-type]
                                               frames_port=port)  # fmt: skip
        try:
            with pytest.raises(KvxferdError) as err:
                if call == "handshake":
                    await table.get("127.0.0.1:1", "e", 1)
                else:
                    await getattr(table, call)("127.0.0.1:1", requests[call])
            if status == 200:
                assert isinstance(err.value, HandshakeError) and "invalid" in str(err.value)
            if call == "handshake":
                assert loaded == [] and table.outcomes == {"bad_answer": 1}
        finally:
            table._peers.clear()
            await table.close()

    asyncio.run(scenario())


def test_a_framed_port_at_its_connection_cap_sends_the_claim_over_http_for_that_call():
    # A flood of the framed port (its cap: 1,024) closes each new connection as it is accepted,
    # before a frame is read: the claim was taken by no one, so it goes over HTTP (the peer
    # API's own listener and cap) instead of failing its pull as "unreachable". The port is
    # tried again by the next call: it is full, not closed.
    import socket

    import msgspec

    from kvxferd.api.frames import FrameLimits, FrameServer
    from kvxferd.api.operations import Gate
    from kvxferd.sidecar.peers import Peer
    from kvxferd.wire import ClaimRequest, ClaimResponse, Ticket
    from tests.sidecar.harness import plan

    grant = ClaimResponse(hold_id="h", expires_at=1e9, expected_readers=1, claim_s=1.0)
    ticket = Ticket(
        engine_id="e", epoch=1, hold_id="h", request_id="r", block_ids=[[1]], num_tokens=1,
        expires_at=0.0, tp_rank=0, tp_size=1, peer="127.0.0.1:1",
    )  # fmt: skip

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r")[0]))
        body = msgspec.json.encode(grant)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))  # fmt: skip
        await writer.drain()
        writer.close()

    async def scenario() -> tuple[object, list, bool]:
        full = FrameServer([], None, Gate(), FrameLimits(max_connections=0, max_frame_bytes=4096))
        listener = socket.create_server(("127.0.0.1", 0))
        await full.start(listener)
        http_server = await asyncio.start_server(http, "127.0.0.1", 0)
        address = f"127.0.0.1:{http_server.sockets[0].getsockname()[1]}"
        calls: list[tuple[str, str]] = []
        table = _table()
        table._on_call = lambda call, wire: calls.append((call, wire))
        manifest = plan("llama-3.1-8b", num_blocks=4)
        table._peers[address] = Peer(address, "e", 1, "a", manifest, (),
                                     frames_port=listener.getsockname()[1])  # fmt: skip
        request = ClaimRequest(ticket=ticket, reader="me", reader_tp_size=1, claim_s=1.0)
        try:
            got = await asyncio.wait_for(table.claim(address, request), 10.0)
            return got, calls, address in table._http_only
        finally:
            table._peers.clear()
            await table.close()
            http_server.close()
            await full.close()

    got, calls, http_only = asyncio.run(scenario())
    assert got == grant
    assert calls == [("claim", "http")]
    assert not http_only
