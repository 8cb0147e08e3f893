"""jsonbody.parse reads at most MAX_KEYS top-level keys: a body of more is refused at the first
key past them, before the others are built; a body within the bound is read as it always was,
however large and however many colons its values hold."""

from __future__ import annotations

import json
import tracemalloc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.api.jsonbody import LENIENT_BYTES, MAX_KEYS, BodyError, TooManyKeysError, parse

WHOLE = msgspec.json.Decoder(dict[str, msgspec.Raw])
PAD = b'"pad": "' + b"." * (5 * MAX_KEYS) + b'"'
"""A first key and value long enough that a body holding them could hold more than MAX_KEYS."""


def keys(n: int, first: int = 0) -> bytes:
    return b",".join(b'"k%d": %d' % (i, i) for i in range(first, first + n))


def as_bytes(body: dict[str, msgspec.Raw]) -> dict[str, bytes]:
    return {k: bytes(v) for k, v in body.items()}


def test_one_key_past_the_bound_is_refused_naming_that_key() -> None:
    with pytest.raises(TooManyKeysError) as caught:
        parse(b"{" + keys(MAX_KEYS + 1) + b"}")
    assert caught.value.key == b'"k%d"' % MAX_KEYS
    said = f'has more than {MAX_KEYS} top-level keys (key {MAX_KEYS + 1} is "k{MAX_KEYS}")'
    assert str(caught.value) == said


def test_a_body_of_as_many_keys_as_the_bound_is_read_whole() -> None:
    content = b"{ " + keys(MAX_KEYS) + b" }"
    assert as_bytes(parse(content)) == as_bytes(WHOLE.decode(content))


def test_a_repeated_key_counts_each_time() -> None:
    with pytest.raises(TooManyKeysError):
        parse(b"{" + b",".join([b'"a": 1'] * (MAX_KEYS + 1)) + b"}")


def test_a_body_of_millions_of_keys_is_refused_without_building_them() -> None:
    """8 MiB of short keys: some 120 MB once built as a dict (~157 bytes a key)."""
    content = b"{" + keys(900_000) + b"}"
    tracemalloc.start()
    try:
        with pytest.raises(TooManyKeysError):
            parse(content)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_keys_past_the_bound_are_refused_even_where_the_body_is_broken_after_them() -> None:
    with pytest.raises(TooManyKeysError):
        parse(b"{" + keys(MAX_KEYS + 5) + b", nope")


def test_a_prompt_full_of_colons_is_read() -> None:
    prompt = b'"' + b'a: \\"b\\": {c}: ' * (1 << 18) + b'"'  # 3.7 MiB, 786k colons
    content = b'{"model": "m", "prompt": ' + prompt + b', "max_tokens": 4}'
    body = parse(content)
    assert bytes(body["prompt"]) == prompt
    assert list(body) == ["model", "prompt", "max_tokens"]


def test_a_chat_of_many_messages_is_read() -> None:
    messages = [{"role": "user", "content": f'turn {i}: {{"a": [{i}]}}'} for i in range(5000)]
    content = msgspec.json.encode({"model": "m", "messages": messages, "stream": True})
    body = parse(content)
    assert json.loads(bytes(body["messages"])) == messages
    assert bytes(body["stream"]) == b"true"


def test_a_value_before_a_long_run_of_blanks_is_kept_without_them() -> None:
    content = b'{"a": [1, 2]' + b" \n" * 3000 + b', "b": "x"   ,' + PAD + b"\t}"
    body = parse(content)
    assert as_bytes(body) == {"a": b"[1, 2]", "b": b'"x"', "pad": PAD[7:]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{" + PAD + b", nope}", "is not JSON"),
        (b"[" + PAD[7:] + b"]", "must be a JSON object"),
        (b"{" + PAD + b', "t": NaN}', "NaN is not a JSON value"),
        (b"{" + PAD + b', "t": 1} x', "is not JSON"),
        (b"{" + PAD + b', "t": 1,}', "is not JSON"),
        (b"{" + PAD + b', "t": 1', "is not JSON"),
        (b"{" + PAD + b', "t": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b"{" + PAD + b', "\\ud800": 1}', "a key that is not text"),
        (b"{" + PAD + b", 7: 1}", "is not JSON"),
    ],
    ids=["syntax", "array", "nan", "trailing", "comma", "unclosed", "nested", "key", "number"],
)
def test_a_large_body_that_is_not_a_json_object_is_refused_as_a_small_one_is(
    content: bytes, message: str
) -> None:
    with pytest.raises(BodyError, match=message):
        parse(content)


def test_a_small_body_read_by_the_stdlib_parser_is_bounded_too() -> None:
    """A lone surrogate escape (msgspec refuses it) in a body of at most LENIENT_BYTES."""
    content = b'{"prompt": "\\ud800", ' + keys(MAX_KEYS) + b"}"
    assert len(content) <= LENIENT_BYTES
    with pytest.raises(TooManyKeysError, match=f'key {MAX_KEYS + 1} is "k{MAX_KEYS - 1}"'):
        parse(content)
    assert (
        json.loads(bytes(parse(b'{"prompt": "\\ud800", ' + keys(3) + b"}")["prompt"])) == "\ud800"
    )


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
    st.sampled_from(['a:b', '"}', "\\", "{[", "\n"]),
)  # fmt: skip
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(
    obj=st.dictionaries(st.text(max_size=6), _VALUES, max_size=8),
    blank=st.sampled_from([b"", b" ", b"\n\t ", b"\r\n"]),
    ascii_only=st.booleans(),
)
def test_a_large_body_is_read_as_msgspec_reads_it_whole(
    obj: dict[str, object], blank: bytes, ascii_only: bool
) -> None:
    """Bodies past the size where the bound applies (read key by key) against msgspec's own
    dict of the same body: the same keys in the same order, each value the same bytes."""
    text = json.dumps(obj, ensure_ascii=ascii_only, indent=1 if blank else None).encode()
    text = text.replace(b"\n", blank or b"\n") if blank else text
    content = blank + b"{" + PAD + (b", " + text[1:] if obj else b"}") + blank
    assert len(content) > 5 * MAX_KEYS
    got = parse(content)
    assert list(got) == list(WHOLE.decode(content))
    assert as_bytes(got) == as_bytes(WHOLE.decode(content))
