"""OpenAI request parsing names the wrong field; replies and SSE chunks have OpenAI's shapes."""

from __future__ import annotations

import json

import pytest

from kvxferd.errors import InvalidRequestError, UnknownModelError
from kvxferd.sim.protocol import DEFAULT_MAX_TOKENS, Reply, error_body, parse
from kvxferd.sim.tokens import chat_prompt, tokenize

MODEL = "org/model"


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_completion_with_a_string_prompt():
    req = parse("completion", _body(prompt="hi there", max_tokens=3, stream=True), MODEL)
    assert req.tokens == tokenize("hi there")
    assert (req.max_tokens, req.stream, req.include_usage) == (3, True, False)
    assert req.kv_transfer_params is None


def test_completion_prompt_forms_and_defaults():
    assert parse("completion", _body(prompt=["hi"]), MODEL).tokens == tokenize("hi")
    assert parse("completion", _body(prompt=[5, 6, 7]), MODEL).tokens == [5, 6, 7]
    assert parse("completion", _body(prompt=[[5, 6]]), MODEL).tokens == [5, 6]
    assert parse("completion", _body(prompt="x", model=MODEL), MODEL).max_tokens == (
        DEFAULT_MAX_TOKENS
    )


def test_chat_renders_messages_into_one_prompt():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                "text": "b"}]}, {"role": "assistant", "content": None}]  # fmt: skip
    req = parse("chat", _body(messages=messages, max_completion_tokens=4,
                              stream_options={"include_usage": True}), MODEL)  # fmt: skip
    assert req.tokens == tokenize(chat_prompt([("user", "ab"), ("assistant", "")]))
    assert req.max_tokens == 4 and req.include_usage


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        ("completion", b"{nope", "body"),
        ("completion", b"[1, 2]", "body"),
        ("completion", _body(max_tokens=3), "prompt"),
        ("completion", _body(prompt=["a", "b"]), "prompt"),
        ("completion", _body(prompt=[1, -2]), "prompt[1]"),
        ("completion", _body(prompt="a", max_tokens=0), "max_tokens"),
        ("completion", _body(prompt="a", max_tokens=True), "max_tokens"),
        ("completion", _body(prompt="a", stream="yes"), "stream"),
        ("completion", _body(prompt="a", n=2), "n"),
        ("completion", _body(prompt="a", kv_transfer_params=[1]), "kv_transfer_params"),
        ("chat", _body(messages=[]), "messages"),
        ("chat", _body(messages=[{"content": "x"}]), "messages[0].role"),
        ("chat", _body(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
        ("chat", _body(messages=[{"role": "u", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0]"),
        ("chat", _body(messages=[{"role": "u", "content": "x"}], max_completion_tokens=-1),
         "max_completion_tokens"),
    ],
)  # fmt: skip
def test_invalid_requests_name_the_field(kind, body, field):
    with pytest.raises(InvalidRequestError) as info:
        parse(kind, body, MODEL)
    assert info.value.field == field
    assert not isinstance(info.value, UnknownModelError)


def test_another_model_is_unknown():
    with pytest.raises(UnknownModelError, match="`other` does not exist"):
        parse("completion", _body(prompt="a", model="other"), MODEL)


def _events(chunks) -> list[object]:
    raw = b"".join(chunks).decode()
    assert raw.endswith("\n\n")
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert all(e != raw for e in events)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_reply_and_stream_carry_the_same_text():
    params = {"do_remote_prefill": True}
    reply = Reply.new("completion", MODEL, [" a", " b"], 5, params)
    body = reply.body()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == " a b"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert body["kv_transfer_params"] == params
    events = _events(reply.chunks(include_usage=True))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == " a b"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["kv_transfer_params"] == params
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 7
    assert {e["id"] for e in events} == {body["id"]}


def test_chat_reply_and_stream_carry_the_same_text():
    reply = Reply.new("chat", MODEL, [" x", " y", " z"], 4)
    body = reply.body()
    assert body["object"] == "chat.completion" and "kv_transfer_params" not in body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " x y z"}
    events = _events(reply.chunks(include_usage=False))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == " x y z"
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}  # fmt: skip


def test_error_body_is_openai_shaped():
    assert error_body(400, "prompt: required", "prompt") == {
        "error": {
            "message": "prompt: required",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": 400,
        }  # fmt: skip
    }
