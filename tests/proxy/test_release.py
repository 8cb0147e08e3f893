"""When the decode will not read what a prefill holds (refused, failed, or its client gone at any
point before the decode had the request), the proxy tells the prefill to release it, or, where
that cannot work, hangs up so the prefill stops; a served decode releases nothing. Fake backends
over real loopback HTTP (tests.proxy.rig)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

import httpx
import pytest

from kvxferd.proxy import app as proxy_app_module
from tests.proxy.fakes import (
    FakeBackend,
    HeadWatch,
    UnopenedDecode,
)
from tests.proxy.rig import (
    Rig,
    completion,
    prefill_requests,
    release_bodies,
    wait_release,
)
from tests.sidecar.harness import wait_until


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_decode_makes_the_proxy_release_the_prefill(make_rig, stream: bool) -> None:
    rig = make_rig()
    rig.decodes[0].fail_status = 400
    with rig.client() as c:
        resp = c.post(
            "/v1/completions", json=completion(stream=stream), headers={"X-Request-Id": "r9"}
        )
    assert resp.status_code == 400
    [body] = wait_release(rig)
    [decoded] = rig.decodes[0].seen
    assert body == {"kv_transfer_params": decoded.body["kv_transfer_params"]}
    assert [s.headers["x-request-id"] for s in rig.prefills[0].seen] == ["r9", "r9"]


def test_a_client_gone_before_the_decode_had_the_request_makes_the_proxy_release(
    make_rig,
) -> None:
    """Nobody will claim the hold then, and the prefill would pin it until its lease ended."""
    rig = make_rig(timeout_s=120.0, transport=lambda p, d: UnopenedDecode(d))  # far past waits
    _hang_up_when(rig, rig.transport.connecting.is_set, "the decode's connection opening")
    _assert_released_what_the_prefill_answered(rig)
    assert rig.decodes[0].seen == []


def test_a_client_gone_while_a_kept_decode_connection_is_replaced_makes_the_proxy_release(
    make_rig,
) -> None:
    """A kept connection whose write failed never carried the request: until its replacement
    opens, the decode cannot have it, so the client leaving then leaves the hold to nobody."""

    def transport(prefill: int, decode: int) -> UnopenedDecode:
        return UnopenedDecode(decode, opens=1, break_kept=True)

    rig = make_rig(timeout_s=120.0, transport=transport)
    with rig.client() as c:  # leaves a kept connection to the decode
        assert c.post("/v1/completions", json=completion()).status_code == 200
    _hang_up_when(rig, rig.transport.connecting.is_set, "the decode's connection reopening")
    assert rig.transport.broken == 1  # the kept connection's write failed
    _assert_released_what_the_prefill_answered(rig)
    assert len(rig.decodes[0].seen) == 1  # the first request only


def _hang_up_at_head(rig: Rig, backend: FakeBackend, what: str) -> None:
    """The client hangs up once ``backend``'s answer head reached the proxy, its body held back
    until the proxy has let the request go."""
    backend.cut_body = cut = threading.Event()
    try:
        _hang_up_when(rig, rig.transport.headed.is_set, what)
        wait_until(lambda: rig.app.state.clients.busy() == 0, 30.0, "the proxy seeing it gone")
    finally:
        cut.set()


def test_a_client_gone_while_the_prefill_answer_comes_makes_the_proxy_release(make_rig) -> None:
    """The prefill holds KV once it answers, but the tickets come in the answer's body: the
    proxy reads it to its end (within its bounds) after the client left, then releases."""
    rig = make_rig(timeout_s=120.0, transport=lambda p, d: HeadWatch(p))
    _hang_up_at_head(rig, rig.prefills[0], "the prefill's answer head")
    _assert_released_what_the_prefill_answered(rig)
    assert rig.decodes[0].seen == []


def test_a_client_gone_while_a_refusing_decodes_answer_comes_makes_the_proxy_release(
    make_rig,
) -> None:
    """The decode's status says it will not read the hold: its error body still arriving when the
    client leaves changes nothing (the hold was left to its lease)."""
    rig = make_rig(timeout_s=120.0, transport=lambda p, d: HeadWatch(d))
    rig.decodes[0].fail_status = 400
    _hang_up_at_head(rig, rig.decodes[0], "the decode's refusal head")
    _assert_released_what_the_prefill_answered(rig)
    assert len(rig.decodes[0].seen) == 1


def test_a_client_gone_before_the_prefill_answered_makes_the_proxy_release(make_rig) -> None:
    """The prefill finishes a request whose caller left and holds KV for it, but only its answer
    names that KV: the proxy waits for the answer (within its bounds) after the client left,
    then releases exactly what it names."""
    rig = make_rig(timeout_s=120.0)  # far past the waits below
    prefill = rig.prefills[0]
    prefill.hold = threading.Event()
    try:
        _hang_up_when(rig, lambda: prefill.seen, "the prefill has the request")
        wait_until(lambda: rig.app.state.clients.busy() == 0, 30.0, "the proxy seeing it gone")
    finally:
        prefill.hold.set()
    [released] = wait_release(rig)
    assert released == {"kv_transfer_params": prefill.answered[0]}
    assert prefill.left == []  # the proxy kept the connection open for the answer
    assert rig.decodes[0].seen == []


@pytest.mark.parametrize("why", ["release_on_failure off", "background full"])
def test_a_client_gone_before_the_prefill_answered_ends_the_call_when_it_may_not_release(
    make_rig, monkeypatch, why: str
) -> None:
    """With release_on_failure off, or already BACKGROUND_CAP releases under way, the proxy hangs
    up on the prefill at once and releases nothing; the hold the prefill makes anyway is left to
    its lease."""
    if why == "background full":
        monkeypatch.setattr(proxy_app_module, "BACKGROUND_CAP", 0)
    rig = make_rig(timeout_s=120.0, release_on_failure=why != "release_on_failure off")
    prefill = rig.prefills[0]
    prefill.hold = threading.Event()
    try:
        _hang_up_when(rig, lambda: prefill.seen, "the prefill has the request")
        wait_until(lambda: prefill.left, 30.0, "the proxy hangs up on the prefill")
    finally:
        prefill.hold.set()
    wait_until(lambda: prefill.answered, 30.0, "the prefill answering nobody")
    rig.proxy.stop()  # its shutdown waits for the releases it started
    assert release_bodies(prefill) == []
    assert rig.decodes[0].seen == []


def test_a_prefill_without_the_release_route_has_a_gone_clients_call_ended(make_rig) -> None:
    """vLLM has no release route (404) but aborts a request whose caller hangs up: once the proxy
    has had that 404 from a prefill, it hangs up on that prefill as soon as a client goes."""
    rig = make_rig(timeout_s=120.0)
    prefill = rig.prefills[0]
    with rig.client() as c:
        _refused_and_told_404(rig, c)
    prefill.hold = threading.Event()
    try:
        _hang_up_when(
            rig, lambda: len(prefill_requests(prefill)) == 2, "the prefill has the request"
        )
        wait_until(lambda: prefill.left, 30.0, "the proxy hangs up on the prefill")
    finally:
        prefill.hold.set()
    rig.proxy.stop()  # its shutdown waits for the releases it started
    assert len(release_bodies(prefill)) == 1  # after the decode's refusal only


def test_a_prefill_that_answered_a_release_404_is_not_asked_again(make_rig) -> None:
    """A 404 says the prefill has no release route (vLLM): its holds end on its own, so a later
    refused decode sends it nothing more."""
    rig = make_rig()
    prefill = rig.prefills[0]
    with rig.client() as c:
        _refused_and_told_404(rig, c)
        assert c.post("/v1/completions", json=completion()).status_code == 400
    rig.proxy.stop()  # its shutdown waits for any release it started
    assert len(prefill_requests(prefill)) == 2  # both requests were prefilled
    assert len(release_bodies(prefill)) == 1  # the first refusal's release only


def test_a_prefill_that_answered_a_release_404_is_asked_again_once_release_retry_s_passed(
    make_rig,
) -> None:
    """A 404 need not last (a server still starting, or replaced at that address by one with the
    route): past ``release_retry_s`` the next refused decode's release goes to the prefill."""
    rig = make_rig(release_retry_s=0.2)
    prefill = rig.prefills[0]
    with rig.client() as c:
        _refused_and_told_404(rig, c)
        prefill.release_status = 200  # the route is there now

        def asked_again() -> bool:
            assert c.post("/v1/completions", json=completion()).status_code == 400
            wait_until(lambda: not rig.app.state.background, 30.0, "the release to end")
            return len(release_bodies(prefill)) == 2

        wait_until(asked_again, 30.0, "a refusal's release reaching the prefill again")
    [_, body] = release_bodies(prefill)
    assert body == {"kv_transfer_params": prefill.answered[-1]}


def test_a_client_gone_before_the_prefill_had_the_request_ends_the_call(make_rig) -> None:
    """While the prefill's connection is still opening, no byte of the request went out: nothing
    is held, so the proxy gives the call up rather than make the prefill compute for nobody."""
    rig = make_rig(timeout_s=120.0, transport=lambda p, d: UnopenedDecode(p))
    _hang_up_when(rig, rig.transport.connecting.is_set, "the prefill's connection opening")
    wait_until(rig.transport.abandoned.is_set, 30.0, "the proxy giving the connection up")
    rig.proxy.stop()
    assert rig.prefills[0].seen == []


def _refused_and_told_404(rig: Rig, client: httpx.Client) -> None:
    """A decode that refuses every request and a prefill without the release route (vLLM): one
    request, its release answered 404 and read by the proxy."""
    rig.prefills[0].release_status = 404
    rig.decodes[0].fail_status = 400
    assert client.post("/v1/completions", json=completion()).status_code == 400
    wait_release(rig)
    wait_until(lambda: not rig.app.state.background, 30.0, "the proxy reading the 404")


def _hang_up_when(rig: Rig, until: Callable[[], object], what: str) -> None:
    """Send a completion over a raw socket and close it once ``until()`` holds (bounded)."""
    body = json.dumps(completion()).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", rig.proxy.port), timeout=30) as sock:
        sock.sendall(head + body)
        wait_until(until, 30.0, what)


def _assert_released_what_the_prefill_answered(rig: Rig) -> None:
    [released] = wait_release(rig)
    prefilled = prefill_requests(rig.prefills[0])[-1]
    assert released["kv_transfer_params"]["remote_engine_id"] == "P0"  # what the prefill answered
    assert released["kv_transfer_params"]["remote_request_id"] == prefilled.headers["x-request-id"]


def test_a_served_decode_releases_nothing(make_rig) -> None:
    rig = make_rig()
    with rig.client() as c:
        assert c.post("/v1/completions", json=completion()).status_code == 200
    assert release_bodies(rig.prefills[0]) == []
