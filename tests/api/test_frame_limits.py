"""The limits of the frames listener (a FrameServer in-process, in front of the fake sidecar):
its connection cap, frame-size cap, idle timeout, per-connection bound on calls in flight, the
payload budget across its connections, and the gates and error mapping it shares with HTTP (any
body gets HTTP's answer). The fake only stands in for the handlers' results."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from collections.abc import Iterator

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.api.engine import OPERATIONS, engine_app
from kvxferd.api.fdbudget import ACCEPT_BURSTS, fds_needed
from kvxferd.api.frames import FrameLimits
from kvxferd.api.server import frame_limits, listener_limits, peer_frame_limits
from kvxferd.config import Config, replace
from kvxferd.errors import UnknownPullError
from kvxferd.wire import HeartbeatResponse, KeepaliveRequest, PullStatus
from kvxferd.wire.frames import frame
from tests.api.conftest import FakeSidecar
from tests.api.frameio import (
    BOUND_S,
    call,
    closed_by_server,
    connect,
    read_answer,
    request_bytes,
    served,
)
from tests.sidecar.harness import wait_until


def _limits(**kw: object) -> FrameLimits:
    values: dict = {"max_connections": 8, "max_frame_bytes": 4096, "idle_timeout_s": BOUND_S}
    return FrameLimits(**{**values, **kw})  # type: ignore[arg-type]


@pytest.fixture
def path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvxf-") as tmp:
        yield f"{tmp}/e.sock.frames"


class GatedFake(FakeSidecar):
    """pull_status and keepalive wait until ``release`` is set (set from the test's thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.waiting = 0

    async def _gate(self) -> None:
        self.waiting += 1
        while not self.release.is_set():
            await asyncio.sleep(0.005)  # a poll of a cross-thread event, not synchronisation
        self.waiting -= 1

    async def pull_status(self, pull_id: str, wait_s: float) -> PullStatus:
        self._call("pull_status", (pull_id, wait_s))
        await self._gate()
        return PullStatus(pull_id=pull_id, state="done")

    async def keepalive(self, req: KeepaliveRequest) -> HeartbeatResponse:
        self._call("keepalive", req)
        await self._gate()
        return HeartbeatResponse(extended=[t.hold_id for t in req.tickets], missing=[])


def test_connections_past_the_cap_are_closed_at_once(path):
    with served(path, FakeSidecar(), _limits(max_connections=2)) as server:
        with connect(path) as a, connect(path) as b:
            for sock in (a, b):
                sock.sendall(request_bytes(1, "GET /healthz"))
                assert read_answer(sock).status == 200
            with connect(path) as over:
                assert closed_by_server(over)
            a.sendall(request_bytes(2, "GET /healthz"))
            assert read_answer(a).status == 200
        wait_until(lambda: server.connections == 0, BOUND_S, "connections released")
        assert call(path, "GET /healthz")[0] == 200


def test_a_frame_over_the_size_cap_closes_its_connection_before_it_is_read(path):
    fake = FakeSidecar()
    with served(path, fake, _limits(max_frame_bytes=256)):
        with connect(path) as sock:
            sock.sendall(request_bytes(1, "POST /v1/holds/abort", {"hold_id": "h" * 300}))
            assert closed_by_server(sock)
        assert fake.calls == []
        assert call(path, "POST /v1/holds/abort", {"hold_id": "h"})[0] == 204
        assert fake.calls[0][0] == "abort"


def test_an_idle_connection_is_closed(path):
    with served(path, FakeSidecar(), _limits(idle_timeout_s=0.2)) as server:
        with connect(path) as sock:
            assert closed_by_server(sock)
        wait_until(lambda: server.connections == 0, BOUND_S, "connection released")


def test_a_client_that_never_reads_its_answers_is_disconnected(path):
    # Answers pile up until the server cannot write them; without a bound on that wait the
    # connection (and its slot under the cap) would be held forever by anyone who can connect.
    limits = _limits(max_connections=1, idle_timeout_s=0.2, frame_timeout_s=0.2)
    with served(path, FakeSidecar(), limits) as server:
        with connect(path) as sock:
            with contextlib.suppress(OSError):  # reset once the server gives up on us
                sock.sendall(request_bytes(1, "GET /healthz") * 200_000)
            wait_until(lambda: server.connections == 0, BOUND_S, "the connection to close")
        assert call(path, "GET /healthz")[0] == 200


def test_a_connection_waiting_on_a_call_is_not_idle(path):
    fake = GatedFake()
    with served(path, fake, _limits(idle_timeout_s=0.05)), connect(path) as sock:
        sock.sendall(request_bytes(1, "GET /v1/pulls/p1", query={"wait": 5}))
        wait_until(lambda: fake.waiting == 1, BOUND_S, "the call to start")
        fake.release.set()
        answer = read_answer(sock)
    assert (answer.id, answer.status) == (1, 200)


def test_calls_past_the_in_flight_bound_wait_unread_and_answers_come_in_any_order(path):
    fake = GatedFake()
    with served(path, fake, _limits(max_in_flight=2)), connect(path) as sock:
        slow = request_bytes(1, "GET /v1/pulls/p1", query={"wait": 5})
        sock.sendall(slow + slow.replace(b"\x01", b"\x02", 1) + request_bytes(3, "GET /healthz"))
        wait_until(lambda: fake.waiting == 2, BOUND_S, "two calls in flight")
        assert len([c for c in fake.calls if c[0] == "pull_status"]) == 2
        fake.release.set()
        order = [read_answer(sock).id for _ in range(3)]
    assert sorted(order) == [1, 2, 3]
    assert order[0] in (1, 2)  # the third call is read only once a slow one has answered


def test_answers_are_not_held_back_by_a_slower_call(path):
    fake = GatedFake()
    with served(path, fake, _limits()), connect(path) as sock:
        sock.sendall(request_bytes(1, "GET /v1/pulls/p1", query={"wait": 5}))
        sock.sendall(request_bytes(2, "GET /healthz"))
        first = read_answer(sock)
        fake.release.set()
        second = read_answer(sock)
    assert (first.id, second.id) == (2, 1)


def _padded(call_id: int, op: str, size: int, query: dict | None = None) -> bytes:
    """A framed call whose payload is exactly ``size`` bytes (padded by an ignored query)."""
    for pad in range(size):
        raw = request_bytes(call_id, op, query={**(query or {}), "pad": "p" * pad})
        if len(raw) - 4 >= size:
            assert len(raw) - 4 == size, "no padding gives that size"
            return raw
    raise AssertionError(f"a {op} frame is larger than {size} bytes")


def test_stalled_frames_hold_what_they_announced_and_the_next_frame_waits_for_room(path):
    # Two frames whose payloads never finish fill a budget of two frames: a third connection's
    # call waits unread, and is answered once one of them arrives whole.
    limits = _limits(max_frame_bytes=4096, max_bytes_in_flight=8192)
    with served(path, FakeSidecar(), limits) as server, connect(path) as a, connect(path) as b:
        budget = server.budget
        first, second = _padded(1, "GET /healthz", 4096), _padded(2, "GET /healthz", 4096)
        a.sendall(first[:100])
        b.sendall(second[:100])
        wait_until(lambda: budget.taken == 8192, BOUND_S, "both frames to take the budget")
        with connect(path) as c:
            c.sendall(request_bytes(3, "GET /healthz"))
            wait_until(lambda: budget.waiting == 1, BOUND_S, "the third frame to wait")
            assert budget.taken == 8192  # the stalled ones hold what they announced
            a.sendall(first[100:])
            assert read_answer(a).id == 1
            answer = read_answer(c)
            assert (answer.id, answer.status) == (3, 200)
        b.close()
        wait_until(lambda: budget.taken == 0, BOUND_S, "every byte given back")


def test_a_frame_that_finds_no_room_within_the_frame_timeout_closes_its_connection(path):
    fake = GatedFake()
    limits = _limits(max_frame_bytes=4096, max_bytes_in_flight=4096, frame_timeout_s=0.3)
    with served(path, fake, limits) as server, connect(path) as holder:
        holder.sendall(_padded(1, "GET /v1/pulls/p1", 4096, query={"wait": 5}))
        wait_until(lambda: fake.waiting == 1, BOUND_S, "the holder's call to run")
        assert server.budget.taken == 4096  # held while its call runs
        with connect(path) as late:
            late.sendall(request_bytes(2, "GET /healthz"))
            assert closed_by_server(late)
        assert server.budget.waiting == 0
        fake.release.set()
        assert (read_answer(holder).id, call(path, "GET /healthz")[0]) == (1, 200)
        wait_until(lambda: server.budget.taken == 0, BOUND_S, "every byte given back")


def test_a_frame_that_is_not_an_envelope_gives_its_bytes_back_at_once(path):
    with served(path, FakeSidecar(), _limits()) as server, connect(path) as sock:
        sock.sendall(frame(b"\xc1" * 1000))  # 0xc1: never valid msgpack
        assert closed_by_server(sock)
        wait_until(lambda: server.connections == 0, BOUND_S, "the connection to close")
        assert server.budget.taken == 0


@pytest.mark.parametrize(
    ("op", "body", "fail"),
    [
        ("GET /v1/pulls/p9", None, UnknownPullError("no pull p9")),
        ("GET /v1/pulls/p9", None, RuntimeError("boom")),
        ("POST /v1/holds/abort", {"hold_id": "h"}, None),
        ("POST /v1/holds/abort", {"hold_id": 3}, None),
    ],
)
def test_handler_errors_map_as_over_http(path, op, body, fail):
    fake = FakeSidecar()
    fake.fail = fail
    with served(path, fake, _limits()):
        framed = call(path, op, body)
    method, url = op.split(" ", 1)
    with TestClient(engine_app(fake), raise_server_exceptions=False) as http:  # type: ignore[arg-type]
        resp = http.request(
            method, url, content=None if body is None else msgspec.json.encode(body)
        )
    assert framed[0] == resp.status_code
    assert framed[1] == (resp.json() if resp.content else None)


def test_an_unregistered_sidecar_refuses_engine_calls_as_over_http(path):
    with served(path, FakeSidecar(ready=False), _limits(), ready=False):
        status, body = call(path, "GET /v1/released")
        assert call(path, "GET /healthz")[0] == 200
    assert (status, body["error"]) == (503, "NotRegisteredError")


def test_the_frames_listener_counts_in_the_open_file_budget():
    on = Config(peer_token="t")
    off = replace(on, engine_frames_socket="off")
    frames = frame_limits(on)
    extra = fds_needed(listener_limits(on)) - fds_needed(listener_limits(off))
    assert extra == frames.max_connections + ACCEPT_BURSTS * frames.backlog
    assert frames.max_frame_bytes == on.max_body_bytes + on.max_header_bytes


def test_the_framed_peer_listener_counts_in_the_open_file_budget_with_the_peer_cap():
    on = Config(peer_token="t", peer_max_connections=300, engine_max_connections=20)
    off = replace(on, peer_frames_port=-1)
    frames = peer_frame_limits(on)
    extra = fds_needed(listener_limits(on)) - fds_needed(listener_limits(off))
    assert frames.max_connections == 300
    assert extra == 300 + ACCEPT_BURSTS * frames.backlog


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
_BODY_OPS = [op for op in OPERATIONS if op.request is not None]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(op=st.sampled_from(_BODY_OPS), body=_VALUES | st.dictionaries(
    st.sampled_from(["request_id", "block_ids", "hold_id", "tickets", "num_tokens", "x"]),
    _VALUES, max_size=4))  # fmt: skip
def test_any_body_gets_the_same_answer_over_frames_and_http(op, body):
    fake = FakeSidecar()
    name = f"{op.method} {op.path}"
    with tempfile.TemporaryDirectory(prefix="kvxh-") as tmp, served(f"{tmp}/f", fake, _limits()):
        framed = call(f"{tmp}/f", name, body)
    headers = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    with TestClient(engine_app(FakeSidecar()), raise_server_exceptions=False) as http:  # type: ignore[arg-type]
        resp = http.request(op.method, op.path, content=msgspec.msgpack.encode(body),
                            headers=headers)  # fmt: skip
    assert framed == (
        resp.status_code,
        msgspec.msgpack.decode(resp.content) if resp.content else None,
    )
