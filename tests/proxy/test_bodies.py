"""Bodies: the proxy reads top-level keys, passes every other value on as the bytes that came."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from kvxferd.api.jsonbody import LENIENT_BYTES, BodyError, parse
from kvxferd.proxy.bodies import (
    KV_TRANSFER_STUB,
    batch_size,
    decode_body,
    encode,
    prefill_body,
    streams,
    transfer_params,
)


def test_values_go_on_as_the_bytes_that_came() -> None:
    sent = b'{"prompt": [1,  2, 3], "temperature": 0.50, "user": "caf\\u00e9"}'
    out = encode(parse(sent))
    assert out == b'{"prompt":[1,  2, 3],"temperature":0.50,"user":"caf\\u00e9"}'


def test_the_prefill_gets_one_token_no_stream_and_the_stub_and_nothing_else_changes() -> None:
    body = parse(b'{"model": "m", "messages": [], "stream": true, "max_tokens": 9, "n": 4, '
                 b'"stream_options": {"include_usage": true}, "min_tokens": 2}')  # fmt: skip
    out = json.loads(encode(prefill_body(body, chat=True)))
    assert out == {"model": "m", "messages": [], "stream": False, "max_tokens": 1,
                   "max_completion_tokens": 1, "kv_transfer_params": KV_TRANSFER_STUB}  # fmt: skip
    assert json.loads(encode(body))["stream"] is True  # the client's body is not changed


def test_the_decode_gets_the_clients_body_with_the_prefills_params() -> None:
    body = parse(b'{"prompt": "a", "kv_transfer_params": {"forged": 1}, "stream": true}')
    params = transfer_params(b'{"id": "x", "kv_transfer_params": {"remote_engine_id": "P0"}}')
    assert params is not None
    out = json.loads(encode(decode_body(body, params)))
    assert out == {"prompt": "a", "kv_transfer_params": {"remote_engine_id": "P0"}, "stream": True}


@pytest.mark.parametrize(("raw", "expected"), [(b"true", True), (b"false", False),
                                               (b'"true"', False), (b"1", False)])  # fmt: skip
def test_only_a_json_true_asks_for_a_stream(raw: bytes, expected: bool) -> None:
    assert streams(parse(b'{"stream": ' + raw + b"}")) is expected
    assert streams(parse(b"{}")) is False


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{nope", "is not JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"t": NaN}', "NaN is not a JSON value"),
        (b'{"t": -Infinity}', "Infinity is not a JSON value"),
        (b'{"t": 1} x', "is not JSON"),
        (b'{"t": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"\\ud800": 1}', "a key that is not text"),
        (b"\xff", "is not JSON"),
    ],
    ids=["syntax", "array", "nan", "infinity", "trailing", "nested", "key", "utf8"],
)
def test_a_body_that_is_not_a_json_object_is_refused_saying_why(content: bytes, message: str):
    with pytest.raises(BodyError, match=message):
        parse(content)


def test_a_lone_surrogate_goes_on_escaped_in_a_small_body() -> None:
    body = parse(b'{"prompt": "a\\ud800b", "n": 1}')
    out = encode(body)
    assert json.loads(out) == {"prompt": "a\ud800b", "n": 1}
    out.decode()  # UTF-8 throughout: the surrogate travels as its escape


def test_a_large_body_with_a_lone_surrogate_is_refused_not_built() -> None:
    filler = b'"' + b"x" * LENIENT_BYTES + b'"'
    with pytest.raises(BodyError, match="is not JSON"):
        parse(b'{"pad": ' + filler + b', "prompt": "\\ud800"}')


def test_a_bodys_values_are_not_built_into_objects() -> None:
    """8 MiB of empty lists: the stdlib parser allocates ~190 MB for it; this, next to nothing."""
    content = b'{"prompt": [' + b"[]," * ((8 << 20) // 3) + b'[]], "stream": true}'
    tracemalloc.start()
    try:
        body = parse(content)
        out = encode(prefill_body(body, chat=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(content), peak  # the encoded copy (its buffer grown), little else
    assert out.startswith(b'{"prompt":[[],[],') and b'"stream":false' in out


def test_a_prefills_params_must_be_an_object_in_an_object() -> None:
    assert transfer_params(b'{"kv_transfer_params": null}') is None
    assert transfer_params(b'{"kv_transfer_params": [1]}') is None
    assert transfer_params(b'{"choices": []}') is None
    with pytest.raises(BodyError, match="must be a JSON object"):
        transfer_params(b"[]")
    lone = transfer_params(b'{"kv_transfer_params": {"note": "\\udc00"}}')
    assert lone is not None and json.loads(bytes(lone)) == {"note": "\udc00"}


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        (b'"one"', 1),
        (b"[1, 2, 3]", 1),  # token ids: one prompt
        (b'["one"]', 1),
        (b"[[1, 2]]", 1),
        (b"[]", 1),
        (b'["one", "two"]', 2),
        (b'[ "a", "b", "c"]', 3),
        (b"[[1], [2, 3]]", 2),
    ],
)
def test_a_completions_prompt_is_a_batch_only_as_a_list_of_prompts(
    prompt: bytes, prompts: int
) -> None:
    assert batch_size(parse(b'{"model": "m", "prompt": ' + prompt + b"}")) == prompts
