"""The proxy's own routes, specified against fake OpenAI backends over real loopback HTTP:
``/health`` (one prefill and one decode up) and ``/v1/models`` (from the decodes)."""

from __future__ import annotations

from collections.abc import Callable

from tests.proxy.fakes import free_port
from tests.proxy.rig import Rig


def test_health_needs_one_prefill_and_one_decode(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(n_prefill=2)
    with rig.client() as c:
        ok = c.get("/health")
        rig.prefills[0].healthy = False
        half = c.get("/health")
        rig.backends[1].stop()
        down = c.get("/health")
    assert ok.status_code == 200 and ok.json()["down"] == []
    assert half.status_code == 200 and half.json()["down"] == [rig.backends[0].url]
    assert half.json()["prefill"][rig.backends[0].url] == "HTTP 503"
    assert down.status_code == 503
    assert down.json()["status"] == "unavailable"
    assert down.json()["down"] == [rig.backends[0].url, rig.backends[1].url]
    assert "ConnectError" in down.json()["prefill"][rig.backends[1].url]


def test_models_come_from_the_first_decode(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(n_decode=2)
    with rig.client() as c:
        resp = c.get("/v1/models")
    assert resp.status_code == 200
    assert [m["id"] for m in resp.json()["data"]] == ["D0"]


def test_models_carry_the_clients_authorization_to_the_decode(
    make_rig: Callable[..., Rig],
) -> None:
    """A vLLM decode started with --api-key refuses /v1/models without the client's key."""
    rig = make_rig()
    with rig.client() as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    [seen] = rig.decodes[0].seen
    assert seen.headers["authorization"] == "Bearer k"


def test_models_come_from_the_next_decode_when_the_first_is_down(
    make_rig: Callable[..., Rig],
) -> None:
    """Every decode serves the same model: a client listing models gets the list while any
    decode answers (in the order given), not a 502 because the first one is down."""
    dead = f"http://127.0.0.1:{free_port()}"
    rig = make_rig(first_decode=dead)
    with rig.client() as c:
        listed = c.get("/v1/models")
        rig.backends[1].stop()
        none = c.get("/v1/models")
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["D0"]
    assert none.status_code == 502  # naming every decode and why it did not answer
    message = none.json()["error"]["message"]
    assert dead in message and rig.backends[1].url in message and "ConnectError" in message
