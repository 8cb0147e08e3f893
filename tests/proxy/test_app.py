"""The proxy's routing, specified against fake OpenAI backends over real loopback HTTP."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from kvxferd.api.jsonbody import MAX_KEYS
from kvxferd.proxy import relay
from kvxferd.proxy.bodies import KV_TRANSFER_STUB
from tests.proxy.fakes import (
    free_port,
    sse_events,
)
from tests.proxy.rig import CLIENT_TIMEOUT_S, Rig, completion, release_bodies, wait_release
from tests.sidecar.harness import wait_until


def test_prefill_gets_one_token_no_stream_and_the_stub(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    body = completion(stream=True, stream_options={"include_usage": True}, min_tokens=4, n=2)
    with rig.client() as c, c.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        resp.read()
    [seen] = rig.prefills[0].seen
    assert seen.path == "/v1/completions"
    assert seen.body["max_tokens"] == 1
    assert seen.body["stream"] is False
    assert seen.body["kv_transfer_params"] == KV_TRANSFER_STUB
    assert "stream_options" not in seen.body and "min_tokens" not in seen.body
    assert "n" not in seen.body  # one prompt's KV, one hold: the decode samples n
    assert rig.decodes[0].seen[0].body["n"] == 2
    assert "max_completion_tokens" not in seen.body
    assert seen.body["prompt"] == "hello world"


def test_chat_prefill_also_gets_max_completion_tokens_1(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9}  # fmt: skip
    with rig.client() as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    [p] = rig.prefills[0].seen
    assert p.path == "/v1/chat/completions"
    assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
    [d] = rig.decodes[0].seen
    assert d.body["max_completion_tokens"] == 9 and "max_tokens" not in d.body


def test_decode_gets_original_request_with_prefill_params(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    body = completion(temperature=0.5, min_tokens=4)
    with rig.client() as c:
        resp = c.post("/v1/completions", json=body)
    assert resp.status_code == 200
    [d] = rig.decodes[0].seen
    params = d.body.pop("kv_transfer_params")
    assert d.body == body
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "P0"
    assert params["remote_block_ids"] == [[1, 2, 3]]
    assert resp.json()["choices"][0]["text"] == "D0 decoded from P0"


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_own_transfer_params_reach_no_backend(make_rig, stream: bool) -> None:
    """A client must not point the decode at a KV source of its choosing: the prefill gets the
    stub, the decode what that prefill answered."""
    rig = make_rig()
    forged = {"do_remote_prefill": True, "remote_engine_id": "evil", "remote_host": "6.6.6.6",
              "remote_port": 9, "remote_block_ids": [[7]]}  # fmt: skip
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(stream=stream, kv_transfer_params=forged))
    assert resp.status_code == 200
    assert rig.prefills[0].seen[0].body["kv_transfer_params"] == KV_TRANSFER_STUB
    params = rig.decodes[0].seen[0].body["kv_transfer_params"]
    assert params["remote_engine_id"] == "P0" and params["remote_host"] == "127.0.0.1"


def test_round_robin_cycles_prefills_and_decodes_separately(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(n_prefill=2, n_decode=3)
    with rig.client() as c:
        texts = [c.post("/v1/completions", json=completion()).json()["choices"][0]["text"]
                 for _ in range(6)]  # fmt: skip
    assert texts == [
        "D0 decoded from P0", "D1 decoded from P1", "D2 decoded from P0",
        "D0 decoded from P1", "D1 decoded from P0", "D2 decoded from P1",
    ]  # fmt: skip
    assert [len(f.seen) for f in rig.prefills + rig.decodes] == [3, 3, 2, 2, 2]


def test_same_request_id_to_both_given_or_generated(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with rig.client() as c:
        given = c.post("/v1/completions", json=completion(), headers={"X-Request-Id": "req-42"})
        made = c.post("/v1/completions", json=completion())
    assert given.headers["x-request-id"] == "req-42"
    p_ids = [s.headers["x-request-id"] for s in rig.prefills[0].seen]
    d_ids = [s.headers["x-request-id"] for s in rig.decodes[0].seen]
    assert p_ids == d_ids
    assert p_ids[0] == "req-42"
    assert p_ids[1] == made.headers["x-request-id"] and len(p_ids[1]) >= 16


def test_the_proxys_own_errors_carry_the_request_id_too(make_rig: Callable[..., Rig]) -> None:
    """Its 502s (and 400s) are the answers whose log lines a client most needs to find."""
    rig = make_rig()
    rig.prefills[0].omit_params = True
    with rig.client() as c:
        no_params = c.post("/v1/completions", json=completion(), headers={"X-Request-Id": "r1"})
        bad_body = c.post("/v1/completions", content=b"{nope", headers={"X-Request-Id": "r2"})
        rig.backends[1].stop()
        rig.prefills[0].omit_params = False
        no_decode = c.post("/v1/completions", json=completion(), headers={"X-Request-Id": "r3"})
    assert [no_params.status_code, bad_body.status_code, no_decode.status_code] == [502, 400, 502]
    assert [r.headers.get("x-request-id") for r in (no_params, bad_body, no_decode)] == [
        "r1", "r2", "r3"
    ]  # fmt: skip


def test_authorization_header_reaches_both(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with rig.client() as c:
        c.post("/v1/completions", json=completion(), headers={"Authorization": "Bearer k"})
    assert rig.prefills[0].seen[0].headers["authorization"] == "Bearer k"
    assert rig.decodes[0].seen[0].headers["authorization"] == "Bearer k"


def test_a_backends_cookie_never_rides_on_a_later_request(make_rig: Callable[..., Rig]) -> None:
    """The proxy keeps no cookie jar: one user's backend session must not reach the next user."""
    rig = make_rig()
    rig.prefills[0].set_cookie = "session=alice-secret; Path=/"
    rig.decodes[0].set_cookie = "route=d0-alice; Path=/"
    with rig.client() as c:
        for _ in range(3):
            assert c.post("/v1/completions", json=completion()).status_code == 200
    seen = rig.prefills[0].seen + rig.decodes[0].seen
    assert len(seen) == 6
    assert [s.headers.get("cookie") for s in seen] == [None] * 6


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_is_relayed_byte_for_byte(make_rig: Callable[..., Rig], chat: bool) -> None:
    rig = make_rig()
    if chat:
        messages = [{"role": "user", "content": "x"}]
        path, body = "/v1/chat/completions", {"model": "m", "stream": True, "messages": messages}
    else:
        path, body = "/v1/completions", completion(stream=True)
    with rig.client() as c, c.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        got = b"".join(resp.iter_raw())
    assert got == b"".join(sse_events("D0", "D0 decoded from P0", chat))


def test_prefill_refused_gives_502_naming_it(make_rig: Callable[..., Rig]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    rig = make_rig(n_prefill=0, extra_prefill=dead)
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert dead in message and "prefill" in message and "ConnectError" in message
    assert rig.decodes[0].seen == []


def test_prefill_that_hangs_gives_502_after_the_timeout(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(timeout_s=0.5)
    rig.prefills[0].hang = threading.Event()
    try:
        with rig.client() as c:  # the client waits far longer than the proxy's bound
            resp = c.post("/v1/completions", json=completion())
    finally:
        rig.prefills[0].hang.set()
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert rig.backends[0].url in error["message"]
    assert "timed out" in error["message"] and "0.5 s" in error["message"]
    assert rig.decodes[0].seen == []


def test_prefill_error_is_passed_through(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.prefills[0].fail_status = 400
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "P0 refuses", "type": "BadRequestError",
                                     "code": 7}}  # fmt: skip
    assert rig.decodes[0].seen == []


def test_prefill_without_transfer_params_is_a_502(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.prefills[0].omit_params = True
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 502
    assert "kv_transfer_params" in resp.json()["error"]["message"]
    assert rig.decodes[0].seen == []


@pytest.mark.parametrize("stream", [False, True])
def test_decode_error_is_passed_through(make_rig: Callable[..., Rig], stream: bool) -> None:
    rig = make_rig()
    rig.decodes[0].fail_status = 503
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(stream=stream))
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "D0 refuses"


def test_decode_down_gives_502_naming_it(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    rig.backends[1].stop()
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(stream=True))
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert rig.backends[1].url in message and "decode" in message


def test_bad_json_is_a_400(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with rig.client() as c:
        resp = c.post("/v1/completions", content=b"{nope", headers={"content-type": "x"})
        listed = c.post("/v1/completions", json=[1, 2])
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert listed.status_code == 400
    assert rig.prefills[0].seen == []


def test_a_body_of_too_many_top_level_keys_is_a_400_naming_the_first_past_the_bound(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    many = {"model": "m", "prompt": "hi", **{f"k{i}": 0 for i in range(MAX_KEYS)}}
    with rig.client() as c:
        resp = c.post("/v1/completions", json=many)
        ok = c.post("/v1/completions", json=completion())
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (
        f'more than {MAX_KEYS} top-level keys (key {MAX_KEYS + 1} is "k{MAX_KEYS - 2}")'
        in (error["message"])
    )
    assert ok.status_code == 200 and len(rig.prefills[0].seen) == 1


def test_nan_or_infinity_in_the_body_is_a_400_not_a_crash(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    with rig.client() as c:
        for const in (b"NaN", b"Infinity", b"-Infinity"):
            resp = c.post("/v1/completions", content=b'{"model": "m", "temperature": ' + const
                          + b"}", headers={"content-type": "application/json"})  # fmt: skip
            assert resp.status_code == 400, const
            assert const.lstrip(b"-").decode() in resp.json()["error"]["message"]
        assert c.post("/v1/completions", json=completion()).status_code == 200
    assert len(rig.prefills[0].seen) == 1


def test_a_lone_surrogate_in_the_body_is_relayed_escaped_not_a_500(make_rig) -> None:
    """``"\\ud800"`` is legal JSON that UTF-8 cannot carry: the backends get it escaped."""
    rig = make_rig()
    with rig.client() as c:
        resp = c.post("/v1/completions", content=b'{"model": "m", "prompt": "a\\ud800b"}',
                      headers={"content-type": "application/json"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert rig.prefills[0].seen[0].body["prompt"] == "a\ud800b"
    assert rig.decodes[0].seen[0].body["prompt"] == "a\ud800b"


def test_header_bytes_outside_ascii_reach_both_backends_as_sent(make_rig) -> None:
    rig = make_rig()
    sent = {"X-Request-Id": b"caf\xe9", "Authorization": b"Bearer \xff\x80"}
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(), headers=sent)
    assert resp.status_code == 200, resp.text
    for seen in (rig.prefills[0].seen[0], rig.decodes[0].seen[0]):
        assert seen.headers["x-request-id"].encode("latin-1") == b"caf\xe9"
        assert seen.headers["authorization"].encode("latin-1") == b"Bearer \xff\x80"


@pytest.mark.parametrize(
    "raw", [b'{"x": NaN}', b'{"x": Infinity}', b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
    ids=["nan", "infinity", "nested"],
)  # fmt: skip
def test_prefill_params_that_are_not_json_are_a_502_naming_it(make_rig, raw: bytes) -> None:
    rig = make_rig()
    rig.prefills[0].raw_params = raw
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 502, resp.text
    assert rig.backends[0].url in resp.json()["error"]["message"]
    assert rig.decodes[0].seen == []


def test_prefill_params_with_a_lone_surrogate_reach_the_decode_escaped(make_rig) -> None:
    rig = make_rig()
    rig.prefills[0].raw_params = b'{"remote_engine_id": "P0", "note": "\\udc00"}'
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    params = rig.decodes[0].seen[0].body["kv_transfer_params"]
    assert params == {"remote_engine_id": "P0", "note": "\udc00"}


def test_compressed_answers_are_read_decoded(make_rig) -> None:
    """A backend may gzip its answers unasked: the prefill's params are read from the decoded
    bytes, and the decode's answer reaches the client decoded (the proxy passes on only its
    content type)."""
    rig = make_rig()
    rig.prefills[0].gzip = rig.decodes[0].gzip = True
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    assert "content-encoding" not in resp.headers
    assert resp.json()["choices"][0]["text"] == "D0 decoded from P0"
    assert rig.decodes[0].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "P0"


@pytest.mark.parametrize("stream", [False, True])
def test_a_content_type_outside_latin_1_text_is_relayed_as_its_bytes_not_a_500(
    make_rig, stream: bool
) -> None:
    """httpx reads header bytes as UTF-8 where they are; a "€" then could not be written back
    (a 500, and a streamed decode answer left open)."""
    rig = make_rig()
    sent = (
        b"application/json; note=\xe2\x82\xac"
        if not stream
        else b"text/event-stream; n=\xe2\x82\xac"
    )
    rig.decodes[0].content_type = sent
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion(stream=stream))
    assert resp.status_code == 200, resp.text
    [media] = [v for k, v in resp.headers.raw if k.lower() == b"content-type"]
    assert media.startswith(sent)
    if stream:
        assert resp.content == b"".join(sse_events("D0", "D0 decoded from P0", chat=False))
    else:
        assert resp.json()["choices"][0]["text"] == "D0 decoded from P0"


LIMIT = 4096  # bytes of a backend answer the proxy reads whole, in these tests


def test_a_prefill_answer_past_the_limit_is_a_502_and_no_decode(make_rig) -> None:
    rig = make_rig(max_answer_bytes=LIMIT)
    rig.prefills[0].pad_bytes = 10 * LIMIT
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 502, resp.text
    message = resp.json()["error"]["message"]
    assert rig.backends[0].url in message and f"answer over {LIMIT} bytes" in message
    assert rig.decodes[0].seen == []


def test_a_decode_answer_past_the_limit_is_a_502_and_frees_the_prefill(make_rig) -> None:
    rig = make_rig(max_answer_bytes=LIMIT)
    rig.decodes[0].pad_bytes = 10 * LIMIT
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        assert rig.backends[1].url in message and f"answer over {LIMIT} bytes" in message
        rig.decodes[0].pad_bytes = 0
        assert c.post("/v1/completions", json=completion()).status_code == 200
    wait_release(rig)


def test_the_openai_client_works_through_the_proxy(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    client = openai.OpenAI(base_url=rig.proxy.url + "/v1", api_key="none", max_retries=0,
                           timeout=CLIENT_TIMEOUT_S)  # fmt: skip
    done = client.completions.create(model="m", prompt="a b", max_tokens=4)
    assert done.choices[0].text == "D0 decoded from P0"
    parts = client.completions.create(model="m", prompt="a b", max_tokens=4, stream=True)
    assert "".join(p.choices[0].text for p in parts) == "D0 decoded from P0 "
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == "D0 decoded from P0"
    chunks = client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "D0 decoded from P0 "
    assert [m.id for m in client.models.list()] == ["D0"]
    rig.prefills[0].fail_status = 400
    with pytest.raises(openai.BadRequestError, match="P0 refuses"):
        client.completions.create(model="m", prompt="a b", max_tokens=4)
    client.close()


def test_stub_is_vllms_shape() -> None:
    assert json.loads(json.dumps(KV_TRANSFER_STUB)) == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip


# ------------------------------------------------------------------------------ timeouts by phase

SHORT_S = 0.3  # every per-phase bound of the proxy in these tests


def test_a_slow_but_alive_stream_longer_than_every_bound_is_relayed_whole(make_rig) -> None:
    rig = make_rig(timeout_s=SHORT_S, generation_s=SHORT_S)
    rig.decodes[0].delay_s = SHORT_S / 3  # 6 events: twice the bound in all, never silent long
    with rig.client() as c, c.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        got = b"".join(r.iter_raw())
    expected = sse_events("D0", "D0 decoded from P0", chat=False)
    assert len(expected) * rig.decodes[0].delay_s > SHORT_S
    assert got == b"".join(expected)
    assert release_bodies(rig.prefills[0]) == []


def test_a_long_non_streaming_generation_is_bound_by_the_generation_timeout(make_rig) -> None:
    rig = make_rig(timeout_s=SHORT_S, generation_s=30.0)
    rig.decodes[0].delay_s = 3 * SHORT_S  # longer than the first-byte bound, as in issue 10 item 9
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "D0 decoded from P0"


def test_a_generation_past_its_bound_is_a_502_naming_the_decode_and_frees_the_prefill(
    make_rig,
) -> None:
    rig = make_rig(timeout_s=SHORT_S, generation_s=SHORT_S)
    rig.decodes[0].hang = threading.Event()
    try:
        with rig.client() as c:
            resp = c.post("/v1/completions", json=completion())
    finally:
        rig.decodes[0].hang.set()
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert rig.backends[1].url in message and "decode" in message
    assert f"no first byte within {SHORT_S:g} s" in message
    wait_release(rig)


def test_a_stream_silent_past_the_idle_bound_ends_with_an_error_event(make_rig) -> None:
    rig = make_rig(timeout_s=SHORT_S)
    rig.decodes[0].stall = threading.Event()
    try:
        with rig.client() as c:
            resp = c.post("/v1/completions", json=completion(stream=True))
    finally:
        rig.decodes[0].stall.set()
    assert resp.status_code == 200  # the headers had gone out
    events = [e for e in resp.text.split("\n\n") if e]
    last = json.loads(events[-1].removeprefix("data: "))
    assert rig.backends[1].url in last["error"]["message"]
    assert f"no next chunk within {SHORT_S:g} s" in last["error"]["message"]


def _stream_cut_mid_event(make_rig: Callable[..., Rig]) -> tuple[Rig, httpx.Response]:
    """A streamed completion whose decode stalls in the middle of its second event."""
    rig = make_rig(timeout_s=SHORT_S)
    rig.decodes[0].stall = threading.Event()
    rig.decodes[0].stall_mid_event = True
    try:
        with rig.client() as c:
            return rig, c.post("/v1/completions", json=completion(stream=True))
    finally:
        rig.decodes[0].stall.set()


def test_a_stream_cut_mid_event_ends_with_its_error_event_whole(make_rig) -> None:
    """The error event must not land inside the cut one: a client's SSE parser would read the
    two as one broken event (the OpenAI client: a JSON error, not the proxy's message). Every
    event the client gets is whole."""
    rig, resp = _stream_cut_mid_event(make_rig)
    assert resp.status_code == 200
    events = [json.loads(e.removeprefix("data: ")) for e in resp.text.split("\n\n") if e]
    first = sse_events("D0", "D0 decoded from P0", chat=False)[0]
    assert events[0] == json.loads(first.removeprefix(b"data: "))
    assert len(events) == 2
    assert rig.backends[1].url in events[1]["error"]["message"]
    assert f"no next chunk within {SHORT_S:g} s" in events[1]["error"]["message"]


def test_an_event_past_the_held_bound_goes_on_as_it_comes_and_the_error_event_after_it(
    make_rig, monkeypatch
) -> None:
    monkeypatch.setattr(relay, "HELD_EVENT_BYTES", 8)
    rig, resp = _stream_cut_mid_event(make_rig)
    expected = sse_events("D0", "D0 decoded from P0", chat=False)
    half = expected[1][: len(expected[1]) // 2]
    assert resp.content.startswith(expected[0] + half + b"\n\ndata: ")
    error = json.loads(resp.text.split("\n\n")[-2].removeprefix("data: "))["error"]
    assert rig.backends[1].url in error["message"]


def test_a_client_gone_mid_stream_has_the_proxy_hang_up_on_the_decode(make_rig) -> None:
    """Else the decode would go on generating for nobody; the hold was its own (no release)."""
    rig = make_rig(timeout_s=120.0)  # far past the waits below
    decode = rig.decodes[0]
    decode.stall = threading.Event()
    try:
        with (
            rig.client() as c,
            c.stream("POST", "/v1/completions", json=completion(stream=True)) as r,
        ):
            first = next(r.iter_raw())
        wait_until(lambda: decode.left, 30.0, "the proxy hangs up on the decode")
    finally:
        decode.stall.set()
    assert first == sse_events("D0", "D0 decoded from P0", chat=False)[0]
    assert decode.left == ["/v1/completions"]
    rig.proxy.stop()  # its shutdown waits for the releases it started
    assert release_bodies(rig.prefills[0]) == []


def test_a_refused_decode_connection_is_still_a_502_naming_it(make_rig) -> None:
    rig = make_rig(connect_s=SHORT_S, first_byte_s=30.0, generation_s=30.0)
    rig.backends[1].stop()
    with rig.client() as c:
        resp = c.post("/v1/completions", json=completion())
    assert resp.status_code == 502
    message = resp.json()["error"]["message"]
    assert rig.backends[1].url in message and "ConnectError" in message
    wait_release(rig)


def test_a_client_that_hangs_up_is_not_served_by_the_decode_any_longer(make_rig) -> None:
    """Without this a non-streaming decode went on generating for nobody, up to the generation
    bound, and a client could leave any number of them running. (A prefill call is left to
    finish so that what it holds can be released: see the release tests below.)"""
    rig = make_rig(timeout_s=120.0, generation_s=120.0)  # far past the waits below
    fake = rig.decodes[0]
    fake.hang = threading.Event()
    body = json.dumps(completion()).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    try:
        with socket.create_connection(("127.0.0.1", rig.proxy.port), timeout=30) as sock:
            sock.sendall(head + body)
            wait_until(lambda: fake.seen, 30.0, "the decode has the request")
        wait_until(lambda: fake.left, 30.0, "the proxy hangs up on the decode")
    finally:
        fake.hang.set()
    assert fake.left == ["/v1/completions"]
    rig.proxy.stop()  # its shutdown waits for the releases it started
    assert release_bodies(rig.prefills[0]) == []  # the decode had the request: the hold is its own
