"""A decode that will not read frees the prefill's blocks at once, not at lease expiry: through
the proxy, a refused decode, or a client gone before the prefill answered or before the decode
had the request, makes the proxy release the prefill's holds (``/v1/kv/release``), and the decode
declines the tickets it refused. Real sims and sidecars, the proxy in-process."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvxferd.proxy import ProxySettings, proxy_app
from tests.proxy.fakes import FakeBackend, HeadWatch, UnopenedDecode, fake_app, serve_app
from tests.sidecar.harness import wait_until
from tests.sim.procs import STUB, Sim, running_sims

pytestmark = pytest.mark.nixl

MODEL = "granite-4.0-h-tiny"
POOL = ["--config", MODEL, "--pool-blocks", "30"]
LEASE_S = 600  # far longer than any wait below: only a release can free the blocks in time
BOUND_S = 30.0
PROMPT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, Sim]]:
    with running_sims({
        "prefill": ["--role", "prefill", "--lease", str(LEASE_S), *POOL],
        "decode": ["--role", "decode", *POOL],
    }) as procs:  # fmt: skip
        yield procs


@pytest.fixture
def proxy(sims: dict[str, Sim]) -> Iterator[str]:
    settings = ProxySettings((sims["prefill"].url,), (sims["decode"].url,), timeout_s=BOUND_S)
    served = serve_app(proxy_app(settings))
    yield served.url
    served.stop()


def _all_free(sim: Sim) -> bool:
    s = sim.stats()
    return s["blocks_free"] == s["blocks_total"] and s["holds_outstanding"] == 0


def _prefill(p: Sim) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": STUB}
    resp = p.post("/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def test_a_decode_refusing_through_the_proxy_leaves_no_hold_on_the_prefill(sims, proxy):
    p, d = sims["prefill"], sims["decode"]
    wait_until(lambda: _all_free(p), BOUND_S, "earlier holds to end")
    before, d_before = p.stats(), d.stats()
    resp = httpx.post(f"{proxy}/v1/completions", timeout=BOUND_S,
                      json={"prompt": PROMPT, "max_tokens": 0})  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    wait_until(lambda: _all_free(p), BOUND_S, "the prefill's hold to be released")
    after = p.stats()
    assert after["holds_released"] == before["holds_released"] + 1  # once, by either path
    assert after["holds_expired"] == before["holds_expired"]  # released, not expired
    # Two paths race to release it: the proxy tells the prefill to give the hold up, and the
    # decode declines its tickets (a background task) through its sidecar. Whichever lands
    # second finds the hold gone, so the prefill gave it up at most once.
    assert after["holds_given_up"] - before["holds_given_up"] in (0, 1)
    wait_until(lambda: d.stats()["declined"] == d_before["declined"] + 1, BOUND_S, "decline")


def _hang_up_once(port: int, p: Sim, reached: Callable[[], bool], what: str) -> None:
    """A client sends one completion through the proxy at ``port`` and hangs up once
    ``reached()``: by then the prefill ``p`` holds the request's KV."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        sock.sendall(head % len(body) + body)
        wait_until(reached, BOUND_S, what)
        assert p.stats()["holds_outstanding"] == 1


def test_a_client_gone_before_the_decode_had_the_request_leaves_no_hold(sims):
    p, d = sims["prefill"], sims["decode"]
    wait_until(lambda: _all_free(p), BOUND_S, "earlier holds to end")
    before = p.stats()
    unopened = UnopenedDecode(urlsplit(d.url).port or 80)
    settings = ProxySettings((p.url,), (d.url,), timeout_s=BOUND_S)
    served = serve_app(proxy_app(settings, unopened))
    try:
        _hang_up_once(served.port, p, unopened.connecting.is_set, "the decode's connection")
        wait_until(lambda: _all_free(p), BOUND_S, "the prefill's hold to be released")
    finally:
        served.stop()
    after = p.stats()
    assert after["holds_given_up"] == before["holds_given_up"] + 1  # by the proxy's release
    assert after["holds_expired"] == before["holds_expired"]


def test_a_client_gone_before_the_prefill_answered_leaves_no_hold(sims):
    """The prefill finishes the request and holds its KV whether or not the client is still
    there; the proxy reads the answer after the client left and releases the hold."""
    p, d = sims["prefill"], sims["decode"]
    wait_until(lambda: _all_free(p), BOUND_S, "earlier holds to end")
    before = p.stats()
    answered = threading.Event()  # the prefill's answer reaches the proxy once this is set
    watch = HeadWatch(urlsplit(p.url).port or 80, hold=answered)
    app = proxy_app(ProxySettings((p.url,), (d.url,), timeout_s=BOUND_S), watch)
    served = serve_app(app)
    try:
        _hang_up_once(served.port, p, watch.headed.is_set, "the prefill's answer (held back)")
        wait_until(lambda: app.state.clients.busy() == 0, BOUND_S, "the proxy seeing it gone")
        answered.set()
        wait_until(lambda: _all_free(p), BOUND_S, "the prefill's hold to be released")
    finally:
        answered.set()
        served.stop()
    after = p.stats()
    assert after["holds_given_up"] == before["holds_given_up"] + 1  # by the proxy's release
    assert after["holds_expired"] == before["holds_expired"]


def _front(target: str, mounted: threading.Event) -> FastAPI:
    """One address for the sim at ``target`` whose release route answers 404 (as a server
    without it does) until ``mounted``: a prefill still starting, or replaced at its address."""
    app = FastAPI()

    @app.post("/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        if path == "v1/kv/release" and not mounted.is_set():
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        headers = {"Content-Type": "application/json",
                   "X-Request-Id": request.headers.get("x-request-id", "r")}  # fmt: skip
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            resp = await client.post(f"{target}/{path}", content=await request.body(),
                                     headers=headers)  # fmt: skip
        return Response(resp.content, resp.status_code, media_type="application/json")

    return app


def test_a_release_404_from_a_prefill_stops_its_releases_only_for_release_retry_s(sims):
    """The proxy reads a release 404 as "no release route" (vLLM) and stops asking that prefill,
    but not for good: once the route is there and ``release_retry_s`` passed, a refused
    decode's release reaches the sim again and frees its hold (given up, not expired)."""
    p = sims["prefill"]
    wait_until(lambda: _all_free(p), BOUND_S, "earlier holds to end")
    before = p.stats()
    mounted = threading.Event()
    decode = FakeBackend("D0", "decode")
    decode.fail_status = 400  # refuses every request: the prefill's hold is the proxy's to free
    backends = [serve_app(_front(p.url, mounted)), serve_app(fake_app(decode))]
    settings = ProxySettings((backends[0].url,), (backends[1].url,), timeout_s=BOUND_S,
                             release_retry_s=0.2)  # fmt: skip
    app = proxy_app(settings)
    backends.append(serve_app(app))
    body = {"prompt": PROMPT, "max_tokens": 4}
    try:
        with httpx.Client(base_url=backends[2].url, timeout=BOUND_S) as client:

            def refused() -> None:
                assert client.post("/v1/completions", json=body).status_code == 400
                wait_until(lambda: not app.state.background, BOUND_S, "the proxy's release")

            refused()  # its release answered 404: the hold is left to its lease
            paused_until = time.monotonic() + settings.release_retry_s  # set before this
            assert p.stats()["holds_given_up"] == before["holds_given_up"]
            mounted.set()
            # One request per state, not one per poll: each refused request leaves the sim a
            # hold while releases pause, and a full pool answers 503.
            wait_until(lambda: time.monotonic() > paused_until, BOUND_S, "release_retry_s")
            refused()
            assert p.stats()["holds_given_up"] == before["holds_given_up"] + 1
    finally:
        for served in reversed(backends):
            served.stop()
        for seen in decode.seen:  # the holds left to their lease: freed for the next tests
            p.post("/v1/kv/release", {"kv_transfer_params": seen.body["kv_transfer_params"]})
    wait_until(lambda: _all_free(p), BOUND_S, "every hold released")


def test_release_needs_the_requests_tickets_and_happens_once(sims):
    p = sims["prefill"]
    wait_until(lambda: _all_free(p), BOUND_S, "earlier holds to end")
    params = _prefill(p)
    assert p.stats()["holds_outstanding"] == 1
    forged = {**params, "kvxferd_tickets": [{**params["kvxferd_tickets"][0], "hold_id": "x"}]}
    assert p.post("/v1/kv/release", {"kv_transfer_params": forged}).json() == {"released": 0}
    assert p.stats()["holds_outstanding"] == 1
    assert p.post("/v1/kv/release", {"kv_transfer_params": params}).json() == {"released": 1}
    wait_until(lambda: _all_free(p), BOUND_S, "the released blocks to come back")
    assert p.post("/v1/kv/release", {"kv_transfer_params": params}).json() == {"released": 0}


def test_a_release_of_a_request_the_prefill_does_not_know_releases_nothing_and_is_no_404(sims):
    """The proxy reads a release 404 as "no release route" (vLLM) and stops asking for a while:
    a request this prefill never had (or forgot) is a 200 releasing nothing."""
    params = {**STUB, "remote_request_id": "never-seen", "kvxferd_tickets": [{"hold_id": "h"}]}
    resp = sims["prefill"].post("/v1/kv/release", {"kv_transfer_params": params})
    assert (resp.status_code, resp.json()) == (200, {"released": 0})


def test_a_release_without_params_is_a_400_naming_them(sims):
    resp = sims["prefill"].post("/v1/kv/release", {"nope": 1})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "kv_transfer_params"
