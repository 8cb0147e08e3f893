"""The engine client against a real ``kvxferd serve``: both the blocking and the asyncio client
return wire Structs and raise the sidecar's own error classes, with the field and HTTP status."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import msgspec
import pytest

from kvxferd import calls, errors
from kvxferd.calls import Call, wait_pull
from kvxferd.client import (
    MSGPACK,
    POLL_SLICE_S,
    AsyncEngineClient,
    EngineClient,
    SidecarError,
    SidecarUnreachableError,
    error_for,
)
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import (
    ErrorBody,
    HoldRequest,
    PullRequest,
    PullStatus,
    StoreLoadRequest,
    StoreSaveRequest,
    Ticket,
)
from kvxferd.wire.store import STORE_SAVE_DEADLINE_S
from tests.sidecar.harness import TOKEN, EnginePool, plan, start_sidecar


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """One running sidecar with a registered 8-block llama pool; ``.registered`` its answer."""
    s = start_sidecar(str(tmp_path_factory.mktemp("client")), "client")
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    try:
        with s.client() as client:
            s.registered = client.register(manifest, pool.specs())
            s.manifest, s.pool = manifest, pool
        yield s
    finally:
        assert s.stop() == 0
        pool.close()


def _hold(block_ids=((1,),)) -> HoldRequest:
    return HoldRequest(request_id=f"r-{uuid.uuid4().hex[:8]}",
                       block_ids=[list(g) for g in block_ids], num_tokens=16)  # fmt: skip


def _dead_peer_pull() -> PullRequest:
    """A well-formed pull whose only prefill rank does not exist (nothing listens on port 1)."""
    ticket = Ticket(engine_id="ghost", epoch=1, hold_id="h", request_id="r", block_ids=[[1]],
                    num_tokens=16, expires_at=time.time() + 60, tp_rank=0, tp_size=1,
                    peer="127.0.0.1:1")  # fmt: skip
    ticket = sign_ticket(ticket, TOKEN.encode())  # a forged MAC would be refused before the call
    return PullRequest(tickets=[ticket], block_ids=[[2]], deadline_s=20.0)


# ------------------------------------------------------------------------------ blocking client


def test_register_answers_this_sidecars_identity(sidecar):
    assert sidecar.registered.engine_id == sidecar.engine_id
    assert sidecar.registered.epoch == sidecar.epoch
    assert sidecar.registered.peer_address == sidecar.peer


def test_hold_abort_and_the_released_feed(sidecar):
    with sidecar.client() as client:
        cursor = client.released().cursor
        ticket = client.hold(_hold([[3, 4]]))
        assert (ticket.engine_id, ticket.block_ids, ticket.peer) == (
            sidecar.engine_id, [[3, 4]], sidecar.peer)  # fmt: skip
        client.abort(ticket.hold_id)
        feed = client.released(cursor)
        assert [(h.hold_id, h.reason, h.block_ids) for h in feed.holds] == [
            (ticket.hold_id, "aborted", [[3, 4]])
        ]
        assert client.released(feed.cursor).holds == []
        with pytest.raises(errors.UnknownHoldError) as info:
            client.abort(ticket.hold_id)
        assert info.value.status == 404 and info.value.body.error == "UnknownHoldError"


def test_an_out_of_range_block_is_a_block_id_error_naming_it(sidecar):
    with sidecar.client() as client, pytest.raises(errors.BlockIdError) as info:
        client.hold(_hold([[1, 99]]))
    exc = info.value
    assert (exc.field, exc.status) == ("block_ids[0][1]", 422)
    assert str(exc).startswith("block_ids[0][1]: ") and "99" in exc.reason
    assert not exc.reason.startswith("block_ids[0][1]")


def test_a_duplicate_hold_is_a_409_naming_request_id(sidecar):
    req = _hold([[5]])
    with sidecar.client() as client:
        client.hold(req)
        with pytest.raises(errors.DuplicateHoldError) as info:
            client.hold(req)
    assert (info.value.field, info.value.status) == ("request_id", 409)


def test_a_second_registration_is_a_409_already_registered_error(sidecar):
    with sidecar.client() as client, pytest.raises(errors.AlreadyRegisteredError) as info:
        client.register(sidecar.manifest, sidecar.pool.specs())
    assert info.value.status == 409 and "already" in str(info.value)


def test_a_body_the_sidecar_cannot_type_is_a_sidecar_error_with_the_path(sidecar):
    bad = HoldRequest(request_id="r", block_ids=[["one"]], num_tokens=1)  # type: ignore[list-item]
    with sidecar.client() as client, pytest.raises(SidecarError) as info:
        client.hold(bad)
    exc = info.value
    assert (exc.status, exc.field, exc.body.error) == (422, "block_ids[0][0]", "ValidationError")


def test_an_unknown_pull_is_an_unknown_pull_error_also_when_waiting(sidecar):
    with sidecar.client() as client:
        with pytest.raises(errors.UnknownPullError) as info:
            client.pull_status("nope")
        assert info.value.status == 404 and "nope" in str(info.value)
        with pytest.raises(errors.UnknownPullError):
            client.wait_pull("nope", timeout_s=5.0)


def test_wait_pull_returns_the_failure_of_a_pull_from_a_dead_peer(sidecar):
    with sidecar.client() as client:
        accepted = client.pull(_dead_peer_pull())
        status = client.wait_pull(accepted.pull_id, timeout_s=60.0)
    assert status.state == "failed" and status.reason
    assert status.kv_bytes == 0


def test_a_missing_socket_is_unreachable_without_a_status(tmp_path):
    with (
        EngineClient(str(tmp_path / "nothing.sock")) as client,
        pytest.raises(SidecarUnreachableError) as info,
    ):
        client.released()
    assert info.value.status is None and isinstance(info.value.__cause__, httpx.HTTPError)


# ------------------------------------------------------------------------------ asyncio client


def test_the_async_client_does_the_same(sidecar):
    async def scenario() -> None:
        async with AsyncEngineClient(sidecar.socket) as client:
            cursor = (await client.released()).cursor
            ticket = await client.hold(_hold([[6]]))
            assert ticket.engine_id == sidecar.engine_id
            await client.abort(ticket.hold_id)
            feed = await client.released(cursor)
            assert [(h.hold_id, h.reason) for h in feed.holds] == [(ticket.hold_id, "aborted")]
            with pytest.raises(errors.UnknownHoldError) as unknown:
                await client.abort(ticket.hold_id)
            assert unknown.value.status == 404
            with pytest.raises(errors.BlockIdError) as block:
                await client.hold(_hold([[0, 8]]))
            assert (block.value.field, block.value.status) == ("block_ids[0][1]", 422)
            with pytest.raises(errors.AlreadyRegisteredError):
                await client.register(sidecar.manifest, sidecar.pool.specs())
            accepted = await client.pull(_dead_peer_pull())
            status = await client.wait_pull(accepted.pull_id, timeout_s=60.0)
            assert status.state == "failed"
            assert (await client.pull_status(accepted.pull_id)).state == "failed"

    asyncio.run(scenario())


def test_the_async_client_reports_a_missing_socket(tmp_path):
    async def scenario() -> None:
        async with AsyncEngineClient(str(tmp_path / "nothing.sock")) as client:
            with pytest.raises(SidecarUnreachableError):
                await client.pull_status("p")

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ the shared core


def test_wait_pull_polls_in_bounded_slices_until_its_timeout():
    now = [0.0]
    steps = wait_pull("p", timeout_s=70.0, clock=lambda: now[0])
    waits = []
    call = next(steps)
    with pytest.raises(StopIteration) as done:
        while True:
            waits.append(call.params["wait"])
            assert call.timeout_s > call.params["wait"]  # the HTTP timeout outlives the poll
            now[0] += call.params["wait"]  # the sidecar held the poll that long
            call = steps.send(PullStatus(pull_id="p", state="transferring"))
    assert waits == [POLL_SLICE_S, POLL_SLICE_S, 10.0]
    assert done.value.value.state == "transferring"


def test_wait_pull_stops_at_the_first_final_state():
    steps = wait_pull("p", timeout_s=70.0, clock=lambda: 0.0)
    next(steps)
    with pytest.raises(StopIteration) as done:
        steps.send(PullStatus(pull_id="p", state="done"))
    assert done.value.value.state == "done"


def test_pull_ids_are_quoted_into_the_path():
    steps = wait_pull("a/b?c", timeout_s=0.0, clock=lambda: 0.0)
    assert next(steps).path == "/v1/pulls/a%2Fb%3Fc"


@pytest.mark.parametrize(
    ("body", "kind", "field"),
    [
        (ErrorBody(error="HoldExpiredError", detail="hold_id 'h': lease ended"),
         errors.HoldExpiredError, ""),
        (ErrorBody(error="ManifestError", detail="regions: 1 for 2", field="regions"),
         errors.ManifestError, "regions"),
        (ErrorBody(error="StateError", detail="'a' -> 'b': no"), SidecarError, ""),
        (ErrorBody(error="IncompatiblePeerError", detail="x", field="a,b"), SidecarError, "a,b"),
        (ErrorBody(error="NotRegisteredError", detail="no engine"), errors.NotRegisteredError,
         ""),
        (ErrorBody(error="NotReady", detail="no engine"), errors.NotRegisteredError, ""),
        (ErrorBody(error="__class__", detail="sneaky"), SidecarError, ""),
        (ErrorBody(error="ValueError", detail="not ours"), SidecarError, ""),
    ],
    ids=["message-only", "field-and-reason", "other-ctor", "incompatible", "not-registered",
         "former-not-ready", "dunder", "foreign"],
)  # fmt: skip
def test_error_answers_rebuild_the_sidecars_class_or_fall_back(body, kind, field):
    exc = error_for(418, body)
    assert type(exc) is kind
    assert (exc.status, exc.body) == (418, body)
    assert getattr(exc, "field", "") == field
    if isinstance(exc, errors.ManifestError):
        assert str(exc) == body.detail  # the field is named once


def test_an_error_answer_that_is_not_an_error_body_keeps_status_and_text():
    call = Call("GET", "/v1/released")
    resp = httpx.Response(502, text="<html>bad gateway</html>")
    with pytest.raises(SidecarError) as info:
        call.result(resp)
    assert info.value.status == 502 and "bad gateway" in info.value.body.detail


def test_an_unusable_success_answer_is_a_sidecar_error():
    call = Call("GET", "/v1/pulls/p", PullStatus)
    with pytest.raises(SidecarError) as info:
        call.result(httpx.Response(200, content=msgspec.json.encode({"pull_id": 3})))
    assert info.value.status == 200 and info.value.body.error == "DecodeError"


def test_a_run_pull_waits_past_the_pulls_deadline_and_the_feed_is_paged():
    call = calls.run_pull(_dead_peer_pull())
    assert (call.method, call.path) == ("POST", "/v1/pulls/run")
    assert call.request_args()["timeout"] > _dead_peer_pull().deadline_s  # answered at its end
    feed = calls.finished_pulls(4, 16)
    assert (feed.path, feed.params) == ("/v1/pulls/finished", {"cursor": 4, "limit": 16})


def test_run_pull_answers_the_failure_of_a_pull_from_a_dead_peer(sidecar):
    with sidecar.client() as client:
        status = client.run_pull(_dead_peer_pull())
        feed = client.finished_pulls(0)
    assert (status.state, status.reason) == ("failed", "handshake")
    assert any(f.pull_id == status.pull_id and f.failed_block_ids == [[2]] for f in feed.pulls)


def test_calls_that_touch_the_engines_memory_say_when_the_engine_gives_them_up():
    """A stalled sidecar must not act on a call the engine gave up (kvxferd.sidecar.expiry)."""
    t0 = time.monotonic_ns()
    hold = calls.hold(_hold([[7]]), 7.0).body
    pull = calls.pull(_dead_peer_pull()).body
    run = calls.run_pull(_dead_peer_pull()).body
    keys = ["0" * 32]
    save = calls.store_save(StoreSaveRequest(request_id="r", keys=keys, block_ids=[[1]])).body
    load = calls.store_load(StoreLoadRequest(keys=keys, block_ids=[[1]], num_tokens=16,
                                             deadline_s=4.0)).body  # fmt: skip
    t1 = time.monotonic_ns()
    for req, act_s in [(hold, 7.0), (pull, 20.0), (run, 20.0), (save, STORE_SAVE_DEADLINE_S),
                       (load, 4.0)]:  # fmt: skip
        assert t0 + act_s * 1e9 <= req.not_after_ns <= t1 + act_s * 1e9, req
    mine = msgspec.structs.replace(_hold([[7]]), not_after_ns=5)
    assert calls.hold(mine, 7.0).body.not_after_ns == 5  # the caller's own stays
    nan = msgspec.structs.replace(_dead_peer_pull(), deadline_s=float("nan"))
    assert calls.pull(nan).body.not_after_ns == 0  # no time: the sidecar's 422 names deadline_s


# ------------------------------------------------------------------------------ the two encodings


@pytest.mark.parametrize("packed", [False, True], ids=["json", "msgpack"])
def test_both_encodings_give_the_same_structs_and_errors(sidecar, packed):
    with EngineClient(sidecar.socket, msgpack=packed) as client:
        cursor = client.released().cursor
        ticket = client.hold(_hold([[7]]))
        assert (ticket.engine_id, ticket.block_ids) == (sidecar.engine_id, [[7]])
        client.abort(ticket.hold_id)
        feed = client.released(cursor)
        assert [(h.hold_id, h.reason) for h in feed.holds] == [(ticket.hold_id, "aborted")]
        with pytest.raises(errors.BlockIdError) as block:
            client.hold(_hold([[0, 8]]))
        assert (block.value.field, block.value.status) == ("block_ids[0][1]", 422)
        status = client.run_pull(_dead_peer_pull())
        assert (status.state, status.reason) == ("failed", "handshake")
        finished = client.finished_pulls(0)
        assert any(f.pull_id == status.pull_id for f in finished.pulls)
        assert client.identity().engine_id == sidecar.engine_id  # JSON either way


def test_msgpack_is_used_for_the_per_request_calls_only():
    req = _dead_peer_pull()
    run = calls.run_pull(req)
    packed = run.request_args(msgpack=True)
    assert packed["headers"] == {"Content-Type": MSGPACK, "Accept": MSGPACK}
    sent = msgspec.msgpack.decode(packed["content"], type=PullRequest)
    assert sent == msgspec.structs.replace(req, not_after_ns=sent.not_after_ns) == run.body
    assert run.request_args(msgpack=False)["headers"] == {"Content-Type": "application/json"}
    assert calls.finished_pulls(0, 8).request_args(msgpack=True)["headers"] == {"Accept": MSGPACK}
    assert "headers" not in calls.identity().request_args(msgpack=True)
    manifest = plan("llama-3.1-8b", num_blocks=2)
    register = calls.register(manifest, []).request_args(msgpack=True)
    assert register["headers"] == {"Content-Type": "application/json"}


def test_answers_are_decoded_by_their_content_type():
    call = Call("GET", "/v1/pulls/p", PullStatus, lean=True)
    status = PullStatus(pull_id="p", state="done", kv_bytes=8)
    packed = httpx.Response(200, content=msgspec.msgpack.encode(status),
                            headers={"Content-Type": MSGPACK})  # fmt: skip
    assert call.result(packed) == status
    assert call.result(httpx.Response(200, content=msgspec.json.encode(status))) == status
    err = ErrorBody(error="UnknownPullError", detail="no pull 'p'")
    with pytest.raises(errors.UnknownPullError) as info:
        call.result(httpx.Response(404, content=msgspec.msgpack.encode(err),
                                   headers={"Content-Type": MSGPACK}))  # fmt: skip
    assert info.value.body == err and info.value.status == 404
