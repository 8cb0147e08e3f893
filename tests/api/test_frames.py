"""The framed engine API (kvxferd.api.frames) of a real ``kvxferd serve``: every operation of the
route table answers over frames exactly what it answers over HTTP/msgpack (status and body), the
socket is 0600, and garbage closes only the connection that sent it."""

from __future__ import annotations

import asyncio
import os
import stat
import uuid

import pytest

from kvxferd.api.engine import OPERATIONS
from kvxferd.client import frames_available
from kvxferd.wire import MAX_GROUPS
from tests.api.frameio import call, closed_by_server, connect, http_call, read_answer, request_bytes
from tests.sidecar.harness import EnginePool, plan, start_sidecar


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """A running sidecar with a registered 8-block llama pool; ``.frames`` its frames socket."""
    s = start_sidecar(str(tmp_path_factory.mktemp("frames")), "f")
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    try:
        with s.client() as client:
            client.register(manifest, pool.specs())
        s.frames, s.manifest = s.socket + ".frames", manifest
        yield s
    finally:
        assert s.stop() == 0
        pool.close()
    assert not os.path.exists(s.frames), "the frames socket outlived the sidecar"


def _op_name(op) -> str:  # noqa: ANN001
    return f"{op.method} {op.path.replace('{pull_id}', 'no-such-pull')}"


def test_the_frames_socket_is_0600_beside_the_engine_socket(sidecar):
    mode = os.stat(sidecar.frames).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


@pytest.mark.parametrize("op", [op for op in OPERATIONS if op.handler is not None],
                         ids=lambda op: op.operation_id)  # fmt: skip
def test_every_operation_answers_as_over_http(sidecar, op):
    """An empty object as the body (a 422 naming the missing field) or no body and no query."""
    name = _op_name(op)
    body = {} if op.request is not None else None
    framed = call(sidecar.frames, name, body)
    assert framed[1].get("error") not in ("NotFound", "MethodNotAllowed")  # routed to it
    assert framed == http_call(sidecar.socket, name, body)


_PAST_GROUPS = [[1]] * (MAX_GROUPS + 1)
"""One id list more than a call may name."""


def _hold(block_ids: list[list[int]]) -> dict:
    return {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": block_ids, "num_tokens": 3}


@pytest.mark.parametrize(
    ("op", "body", "query", "status", "field"),
    [
        ("POST /v1/holds", _hold([[1, 99]]), None, 422, "block_ids[0][1]"),
        ("POST /v1/holds", {"request_id": 5, "block_ids": [[1]]}, None, 422, "request_id"),
        ("POST /v1/holds", "not an object", None, 422, ""),
        ("POST /v1/pulls/run", {"tickets": [], "block_ids": _PAST_GROUPS}, None, 422, "block_ids"),
        ("POST /v1/pulls/run", {"tickets": []}, None, 422, "block_ids"),
        ("GET /v1/pulls/finished", None, {"cursor": -1}, 422, "cursor"),
        ("GET /v1/released", None, {"limit": "many"}, 422, "limit"),
        ("GET /v1/pulls/no-such-pull", None, {"wait": 0}, 404, ""),
        ("POST /v1/holds/abort", {"hold_id": "nope"}, None, 404, ""),
        ("GET /v1/nothing", None, None, 404, ""),
        ("DELETE /v1/holds", None, None, 405, ""),
    ],
)
def test_bad_inputs_get_the_same_error_as_over_http(sidecar, op, body, query, status, field):
    framed = call(sidecar.frames, op, body, query)
    assert framed[0] == status
    assert framed[1]["field"] == field
    assert framed == http_call(sidecar.socket, op, body, query)


def test_answers_come_by_id_for_many_requests_on_one_connection(sidecar):
    ops = ["GET /v1/identity", "GET /healthz", "GET /v1/released", "GET /v1/pulls/x"] * 8
    with connect(sidecar.frames) as sock:
        sock.sendall(b"".join(request_bytes(100 + i, op) for i, op in enumerate(ops)))
        answers = {a.id: a.status for a in (read_answer(sock) for _ in ops)}
    assert answers == {100 + i: (404 if op.endswith("/x") else 200) for i, op in enumerate(ops)}


GARBAGE = [
    pytest.param(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", id="not-msgpack"),
    pytest.param(b"\x00\x00\x00\x01\x07", id="not-an-envelope"),
    pytest.param(b"\x00\x00\x00\x03\x81\xa2id", id="truncated-envelope"),
    pytest.param(b"\x00\x00\x00\x05\x81\xa2id\x01", id="envelope-without-op"),
    pytest.param(b"\x00\x00\x00\x0a\x82\xa2id\xa1X\xa2op\xa1X", id="id-not-an-int"),
    pytest.param(b"\xff\xff\xff\xff" + b"x" * 100, id="oversized"),
    pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", id="http-on-the-frames-socket"),
]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_closes_that_connection_only_and_the_daemon_serves_on(sidecar, garbage):
    with connect(sidecar.frames) as good, connect(sidecar.frames) as bad:
        bad.sendall(garbage)
        assert closed_by_server(bad)
        good.sendall(request_bytes(1, "GET /healthz"))
        assert read_answer(good).status == 200  # a connection opened before is untouched
    assert call(sidecar.frames, "GET /v1/identity")[0] == 200  # and a new one is served
    assert http_call(sidecar.socket, "GET /healthz")[0] == 200


def test_a_truncated_frame_from_a_client_that_goes_away_leaves_the_daemon_serving(sidecar):
    with connect(sidecar.frames) as sock:
        sock.sendall(request_bytes(1, "GET /healthz")[:9])
    assert call(sidecar.frames, "GET /healthz")[0] == 200


def test_frames_off_serves_http_only_and_the_sims_clients_fall_back_to_it(tmp_path):
    s = start_sidecar(str(tmp_path), "o", "--engine-frames-socket", "off")
    try:
        assert not os.path.exists(s.socket + ".frames")
        assert not frames_available(s.socket)

        async def scenario() -> None:
            client = s.async_client()
            try:
                assert (await client.identity()).engine_id == s.engine_id
            finally:
                await client.aclose()

        asyncio.run(scenario())
    finally:
        assert s.stop() == 0
