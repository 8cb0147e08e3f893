"""The sidecar's table caps on the engine API of a real ``kvxferd serve``, over HTTP and frames:
a hold past ``--max-holds`` and a pull past ``--max-pulls-in-flight`` are a 503 naming the limit,
a pull deadline past ``--max-pull-deadline`` a 422 naming ``deadline_s``; nothing is kept of a
refused call."""

from __future__ import annotations

import socket
import uuid

import msgspec
import pytest

from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import Ticket
from tests.api.frameio import BOUND_S, call, http_call
from tests.sidecar.harness import TOKEN, EnginePool, plan, start_sidecar


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """A sidecar with tiny caps (flags, and one from the environment) and a registered pool."""
    s = start_sidecar(str(tmp_path_factory.mktemp("caps")), "c", "--max-holds", "2",
                      "--max-pull-deadline", "60",
                      env={"KVXFERD_MAX_PULLS_IN_FLIGHT": "1",
                           "KVXFERD_HANDSHAKE_TIMEOUT_S": "60"})  # fmt: skip
    pool = EnginePool(plan("llama-3.1-8b", num_blocks=8))
    try:
        with s.client() as client:
            client.register(pool.manifest, pool.specs())
        s.frames = s.socket + ".frames"
        yield s
    finally:
        assert s.stop() == 0
        pool.close()


def _hold() -> dict:
    return {"request_id": f"r-{uuid.uuid4().hex[:8]}", "block_ids": [[1, 2]], "num_tokens": 3}


def test_a_hold_past_max_holds_is_a_503_naming_the_limit(sidecar):
    placed = [call(sidecar.frames, "POST /v1/holds", _hold()) for _ in range(2)]
    assert [status for status, _ in placed] == [200, 200]
    for wire, path in ((call, sidecar.frames), (http_call, sidecar.socket)):
        status, body = wire(path, "POST /v1/holds", _hold())
        assert (status, body["error"], body["field"]) == (503, "CapacityError", "max_holds")
    for _, ticket in placed:
        assert (
            call(sidecar.frames, "POST /v1/holds/abort", {"hold_id": ticket["hold_id"]})[0] == 204
        )
    assert call(sidecar.frames, "POST /v1/holds", _hold())[0] == 200  # room again


def _pull(peer: str, deadline_s: float) -> dict:
    ticket = Ticket(engine_id="p", epoch=1, hold_id=f"h-{uuid.uuid4().hex[:8]}", request_id="r",
                    block_ids=[[1]], num_tokens=1, expires_at=0.0, tp_rank=0, tp_size=1,
                    peer=peer)  # fmt: skip
    signed = msgspec.to_builtins(sign_ticket(ticket, TOKEN.encode()))
    return {"tickets": [signed], "block_ids": [[5]], "deadline_s": deadline_s}


@pytest.mark.parametrize("path", ["POST /v1/pulls", "POST /v1/pulls/run"])
def test_a_pull_deadline_past_the_maximum_is_a_422_naming_deadline_s(sidecar, path):
    for wire, where in ((call, sidecar.frames), (http_call, sidecar.socket)):
        status, body = wire(where, path, _pull("127.0.0.1:9", 1e9))
        assert (status, body["field"]) == (422, "deadline_s")


def test_a_pull_past_max_pulls_in_flight_is_a_503_naming_the_limit(sidecar):
    # A "prefill" that takes the connection and never answers: the first pull stays handshaking.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        peer = f"127.0.0.1:{silent.getsockname()[1]}"
        status, accepted = call(sidecar.frames, "POST /v1/pulls", _pull(peer, 50.0))
        assert status == 202
        for wire, path in ((call, sidecar.frames), (http_call, sidecar.socket)):
            status, body = wire(path, "POST /v1/pulls", _pull(peer, 50.0))
            assert (status, body["error"], body["field"]) == (503, "CapacityError",
                                                              "max_pulls_in_flight")  # fmt: skip
    # The listener is gone: the first pull fails, and the next one is accepted again.
    pull_id = accepted["pull_id"]
    status, final = call(sidecar.frames, f"GET /v1/pulls/{pull_id}", None, {"wait": BOUND_S})
    assert (status, final["state"]) == (200, "failed")
    status, _ = call(sidecar.frames, "POST /v1/pulls", _pull("127.0.0.1:9", 5.0))
    assert status == 202
