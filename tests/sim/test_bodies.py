"""Request bodies: the sim builds only the fields it reads, and refuses junk in them unbuilt."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from kvxferd.api.jsonbody import LENIENT_BYTES
from kvxferd.errors import InvalidRequestError, UnknownModelError
from kvxferd.sim.protocol import parse, raw_transfer_params, release_params
from kvxferd.sim.tokens import chat_prompt, tokenize

MODEL = "org/model"
JUNK = b"[" + b"[]," * ((4 << 20) // 3) + b"[]]"
"""4 MiB of empty lists: the stdlib parser builds ~90 MB of lists for them."""

CHAT = b'"messages": [{"role": "user", "content": "hi"}]'
HI_CHAT = tokenize(chat_prompt([("user", "hi")]))


def _peak(call) -> int:  # noqa: ANN001
    """The most memory Python held while ``call`` ran, past what it held before."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("completion", b'{"prompt": "hi", "junk": ' + JUNK + b"}"),
        ("chat", b'{"messages": [{"role": "user", "content": "hi", "junk": ' + JUNK + b"}]}"),
        ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", '
                 b'"junk": ' + JUNK + b"}]}]}"),
        ("completion", b'{"prompt": "hi", "stream_options": {"junk": ' + JUNK + b"}}"),
        ("completion", b'{"prompt": "hi", "kv_transfer_params": {"junk": ' + JUNK + b"}}"),
    ],
    ids=["top-level", "message", "content-part", "stream-options", "kv-transfer-params"],
)  # fmt: skip
def test_unknown_fields_are_skipped_without_being_built(kind, body):
    parsed = []
    peak = _peak(lambda: parsed.append(parse(kind, body, MODEL)))
    assert peak < 2 * len(body), peak  # the stdlib parser: ~22x the body
    assert parsed[0].tokens == (tokenize("hi") if kind == "completion" else HI_CHAT)


@pytest.mark.parametrize(
    ("kind", "body", "field"),
    [
        ("completion", b'{"prompt": ' + JUNK + b"}", "prompt"),
        ("completion", b'{"prompt": [' + JUNK + b"]}", "prompt"),
        ("completion", b'{"prompt": [1, ' + JUNK + b"]}", "prompt"),
        ("chat", b'{"messages": ' + JUNK + b"}", "messages[0].role"),
        ("chat", b'{"messages": [{"role": "user", "content": ' + JUNK + b"}]}",
         "messages[0].content[0]"),
        ("chat", b'{"messages": [{"role": ' + JUNK + b', "content": "hi"}]}', "messages[0].role"),
        ("completion", b'{"prompt": "hi", "model": ' + JUNK + b"}", "model"),
        ("completion", b'{"prompt": "hi", "n": ' + JUNK + b"}", "n"),
        ("completion", b'{"prompt": "hi", "stream": ' + JUNK + b"}", "stream"),
        ("completion", b'{"prompt": "hi", "stream_options": ' + JUNK + b"}", "stream_options"),
        ("completion", b'{"prompt": "hi", "kv_transfer_params": ' + JUNK + b"}",
         "kv_transfer_params"),
        ("completion", b'{"prompt": "hi", "max_tokens": ' + JUNK + b"}", "max_tokens"),
        ("chat", b"{" + CHAT + b', "max_completion_tokens": ' + JUNK + b"}",
         "max_completion_tokens"),
    ],
)  # fmt: skip
def test_junk_in_a_known_field_is_refused_without_being_built(kind, body, field):
    def refuse() -> None:
        with pytest.raises(InvalidRequestError) as info:
            parse(kind, body, MODEL)
        assert info.value.field == field
        assert len(str(info.value)) < 200  # shows the start of the junk, not all of it

    assert _peak(refuse) < 2 * len(body)


def test_a_model_of_junk_is_still_an_unknown_model():
    with pytest.raises(UnknownModelError, match=r"the model `\[\[\],\[\],"):
        parse("completion", b'{"prompt": "hi", "model": ' + JUNK + b"}", MODEL)


def test_only_the_transfer_params_the_sim_reads_are_kept():
    body = json.dumps({"prompt": "hi", "kv_transfer_params": {
        "do_remote_decode": True, "remote_request_id": "r", "kvxferd_tickets": [{"hold_id": "h"}],
        "remote_block_ids": [[1]], "other": {"x": 1}}}).encode()  # fmt: skip
    kept = {
        "do_remote_decode": True,
        "remote_request_id": "r",
        "kvxferd_tickets": [{"hold_id": "h"}],
    }
    assert parse("completion", body, MODEL).kv_transfer_params == kept
    assert raw_transfer_params(body) == kept
    assert release_params(body) == kept


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": [1, True]}, "prompt[1]"),
        ({"prompt": [[1, True]]}, "prompt[1]"),
        ({"prompt": [1, 2.0]}, "prompt"),
        ({"prompt": [[1], [2]]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"messages": [{"role": "u", "content": "x"}, 3]}, "messages[1].role"),
        ({"messages": [{"role": "u", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        ({"messages": [{"role": "u", "content": [{"type": "text", "text": "a"}, {"type": 1}]}]},
         "messages[0].content[1]"),
        ({"messages": [{"role": "u", "content": [{"text": "a"}]}]}, "messages[0].content[0]"),
        ({"messages": {"role": "u"}}, "messages"),
    ],
)  # fmt: skip
def test_the_first_part_that_does_not_fit_is_named(body, field):
    kind = "completion" if "prompt" in body else "chat"
    with pytest.raises(InvalidRequestError) as info:
        parse(kind, json.dumps(body).encode(), MODEL)
    assert info.value.field == field


def test_a_lone_surrogate_in_a_small_body_is_read_as_before():
    completion = b'{"prompt": [[5, 6]], "user": "\\ud800", "\\udc00": 1, "stream_options": ' \
        b'{"include_usage": true, "x": "\\ud800"}}'  # fmt: skip
    req = parse("completion", completion, MODEL)
    assert (req.tokens, req.include_usage) == ([5, 6], True)
    chat = b'{"messages": [{"role": "user", "content": "hi", "name": "\\udfff"}], ' \
        b'"kv_transfer_params": {"x": "\\ud800"}}'  # fmt: skip
    assert parse("chat", chat, MODEL).tokens == HI_CHAT


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"prompt": "hi", "max_tokens": "\\ud800"}', "max_tokens"),
        (b'{"prompt": ["\\ud800", 1]}', "prompt"),
        (b'{"messages": ["\\udc00"]}', "messages[0].role"),
        (b'{"messages": [{"role": "u", "content": [{"type": "\\udc00"}]}]}',
         "messages[0].content[0]"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_in_a_known_field_is_named_as_before(body, field):
    kind = "completion" if b"prompt" in body else "chat"
    with pytest.raises(InvalidRequestError) as info:
        parse(kind, body, MODEL)
    assert info.value.field == field


def test_a_lone_surrogate_in_a_body_over_the_lenient_bound_is_refused():
    pad = b'"' + b"x" * LENIENT_BYTES + b'"'
    with pytest.raises(InvalidRequestError) as info:
        parse("completion", b'{"pad": ' + pad + b', "prompt": "hi", "user": "\\ud800"}', MODEL)
    assert info.value.field == "body"
    assert "is not JSON" in str(info.value)
