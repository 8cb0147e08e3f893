"""JSON request bodies read by their top-level keys, each value kept as the bytes that came.

A front door (the proxy's, the sim's) takes bodies of up to 32 MiB from anyone. Built whole by
the stdlib parser, a 32 MiB body of empty lists took 770 MB and 3.7 s of one event loop. Here a
body is checked as JSON and split at its top-level keys, each value kept as sent
(``msgspec.Raw``, never built into objects): :func:`parse` keeps every key (the proxy passes them
on), :func:`fields` only the keys a Struct names (the others are skipped, not even their keys are
built), and :func:`value` decodes one kept value as a type, failing at its first part that does
not fit rather than after building all of it.

:func:`parse` builds one key and one ``msgspec.Raw`` per top-level key, some 157 bytes each: a
32 MiB body of 3.1 million short keys took 494 MB and 3 s of the event loop as one dict (msgspec
checks a dict's ``max_length`` only once it is built). So a body long enough to hold more than
``MAX_KEYS`` keys is read key by key (:func:`_scan`): msgspec skips each key and value (checked,
nothing built) and says where it ends, and the read stops at key ``MAX_KEYS + 1``
(TooManyKeysError naming it): that body now costs 3.6 ms and 0.3 MB. A body within the bound
costs the one msgspec pass it did. ``bytes.count(b":")`` bounds the keys from above but is no
cheap gate: on 32 MiB it takes as long as msgspec's whole pass, and a prompt of colons is
legitimate (``scripts/bench_jsonbody.py`` measures all three).

msgspec refuses one thing JSON allows: an escaped lone surrogate (``"\\ud800"``, which UTF-8
cannot carry). A body of at most ``LENIENT_BYTES`` that msgspec refuses is read by the stdlib
parser instead and its values written anew, ASCII-escaped where UTF-8 cannot carry them (such a
value is read by the stdlib parser again in :func:`value`); past that size such a body is
refused, so no body is ever built whole above that bound.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

Body = dict[str, msgspec.Raw]
"""A JSON object's top-level keys, each with its value's JSON text."""

LENIENT_BYTES = 1 << 20
"""Largest body the stdlib parser reads where msgspec refused it (see the module docstring)."""
MAX_KEYS = 1024
"""Most top-level keys :func:`parse` reads (a repeated key counts each time); an OpenAI request
has a few dozen. At ~157 bytes a key this bounds the dict at ~160 KB past the body."""

T = TypeVar("T")
_OBJECT = msgspec.json.Decoder(Body)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # escaped, as the writer leaves it
_VALUE = msgspec.json.Decoder(msgspec.Raw)
_KEY = msgspec.json.Decoder(str)
_BLANK = re.compile(rb"[ \t\n\r]*")
_TRAILING = re.compile(r"trailing characters \(byte (\d+)\)$")
_COLON, _COMMA, _CLOSE = b":"[0], b","[0], b"}"[0]
_SHOWN = 64  # bytes of a key a refusal shows
_TAIL = 64  # bytes before a separator searched for the end of a value


class BodyError(ValueError):
    """A body that cannot be read: not JSON, or not a JSON object."""


class NotAnObjectError(BodyError):
    """JSON, but not an object (some callers name another culprit for this one)."""


class TooManyKeysError(BodyError):
    """A JSON object with more top-level keys than :func:`parse` reads; ``key`` is the first key
    past the bound, as its JSON text (its first 64 bytes shown; at most 65 kept)."""

    def __init__(self, limit: int, key: bytes) -> None:
        shown = key[:_SHOWN].decode("utf-8", "replace") + ("..." if len(key) > _SHOWN else "")
        super().__init__(f"has more than {limit} top-level keys (key {limit + 1} is {shown})")
        self.limit = limit
        self.key = key


def parse(content: bytes, max_keys: int = MAX_KEYS) -> Body:
    """``content`` as a JSON object's top-level keys; BodyError saying what is wrong,
    TooManyKeysError past ``max_keys`` keys (read no further than the first key past them)."""
    if len(content) > 5 * max_keys:  # room for more: '"":0,' is the shortest key and value
        body = _scan(content, max_keys)
        if body is not None:
            return body
    body = _read(content, _OBJECT, _every_key)
    if len(body) > max_keys:  # read by the stdlib parser: at most LENIENT_BYTES, built whole
        raise TooManyKeysError(max_keys, _json_bytes(list(body)[max_keys]))
    return body


def fields(content: bytes | msgspec.Raw, decoder: msgspec.json.Decoder[T]) -> T:
    """The keys of JSON object ``content`` that ``decoder``'s Struct names (each field a
    ``msgspec.Raw`` with an empty default: absent), values as sent; other keys are skipped
    unbuilt. BodyError as :func:`parse`."""

    def pick(data: dict[str, Any]) -> T:
        kind = decoder.type
        named = [(f.name, f.encode_name) for f in msgspec.structs.fields(kind)]
        return kind(**{n: msgspec.Raw(_json_bytes(data[k])) for n, k in named if k in data})

    return _read(content, decoder, pick)


def value(raw: msgspec.Raw, decoder: msgspec.json.Decoder[T]) -> T:
    """``raw`` (a value :func:`parse` or :func:`fields` kept) decoded as ``decoder``'s type, one
    without ``msgspec.Raw`` in it: msgspec.ValidationError (the path in its message) where it does
    not fit. A value with a lone surrogate is read by the stdlib parser and converted as strictly
    as msgspec decodes; BodyError where that is too large or too deep."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        raise
    except RecursionError:
        raise BodyError("is not JSON: nested too deeply") from None
    except msgspec.DecodeError as exc:
        if len(raw) > LENIENT_BYTES:  # never from parse or fields: they refuse such a body
            raise BodyError(f"is not JSON: {exc}") from None
    try:
        return msgspec.convert(_loads(bytes(raw)), decoder.type, strict=True)
    except UnicodeEncodeError:  # such a string where the type takes none: msgspec says where
        decoder.decode(_SURROGATE.sub(rb"\\ufffd", bytes(raw)))
        raise msgspec.ValidationError("a string where the type takes none") from None


def _read(content: bytes | msgspec.Raw, decoder: msgspec.json.Decoder[T],
          from_data: Callable[[dict[str, Any]], T]) -> T:  # fmt: skip
    """``content`` decoded by ``decoder`` (a JSON object's); where msgspec refuses a body of at
    most LENIENT_BYTES, the stdlib parser's object handed to ``from_data``."""
    try:
        return decoder.decode(content)
    except msgspec.ValidationError:  # JSON, but not an object
        raise NotAnObjectError("must be a JSON object") from None
    except RecursionError:
        raise BodyError("is not JSON: nested too deeply") from None
    except msgspec.DecodeError as exc:
        if len(content) > LENIENT_BYTES:
            raise BodyError(f"is not JSON: {exc}") from None
    data = _loads(bytes(content))
    if not isinstance(data, dict):
        raise NotAnObjectError("must be a JSON object")
    try:
        return from_data(data)
    except RecursionError:  # the stdlib writer nests less deeply than its reader
        raise BodyError("is not JSON: nested too deeply") from None


def _scan(content: bytes, max_keys: int) -> Body | None:
    """:func:`parse` key by key: each key and value is skipped by msgspec (checked, nothing
    built) to find where it ends, and the read stops at key ``max_keys + 1``
    (TooManyKeysError). None where ``content`` is not a JSON object msgspec reads up to there:
    then :func:`_read` says what is wrong, having built no more keys than this read (the same
    parser stops at the same byte)."""
    view = memoryview(content)
    body: Body = {}
    i = _blank(content, 0)
    if content[i : i + 1] != b"{":
        return None
    i = _blank(content, i + 1)
    if content[i : i + 1] == b"}":
        return body if _blank(content, i + 1) == len(content) else None
    for n in range(max_keys + 1):
        colon = _end(view, i) if content[i : i + 1] == b'"' else None
        if colon is None or content[colon] != _COLON:
            return None
        if n == max_keys:
            raise TooManyKeysError(max_keys, content[i : min(colon, i + _SHOWN + 1)].rstrip())
        try:
            key = _KEY.decode(view[i:colon])
        except msgspec.DecodeError:
            return None
        start = _blank(content, colon + 1)
        end = _end(view, start)
        if end is None or content[end] not in (_COMMA, _CLOSE):
            return None
        body[key] = _raw(content, view, start, end)
        if content[end] == _CLOSE:
            return body if _blank(content, end + 1) == len(content) else None
        i = _blank(content, end + 1)
    return None  # not reached: key max_keys + 1 raised above


def _end(view: memoryview, i: int) -> int | None:
    """Where the first byte after the JSON value at ``i`` and the blanks after it is; None where
    no JSON value starts at ``i``, or it runs to the end of ``view``. msgspec checks the value
    and refuses what follows it, naming the byte ("trailing characters (byte N)", counted from
    1): msgspec has no call that decodes a prefix. Were that message to change, every body
    would read as None here and be built whole again (tests/api/test_jsonbody.py says so)."""
    try:
        _VALUE.decode(view[i:])
    except msgspec.DecodeError as exc:
        found = _TRAILING.search(str(exc))
        return i + int(found[1]) - 1 if found else None  # msgspec counts that byte from 1
    except RecursionError:
        return None
    return None


def _raw(content: bytes, view: memoryview, start: int, end: int) -> msgspec.Raw:
    """The value from ``start`` to the blanks before ``end``, as the bytes that came."""
    tail = content[max(start, end - _TAIL) : end]
    if tail.strip(b" \t\n\r"):  # the value ends in these last bytes (as good as always)
        return msgspec.Raw(view[start : end - len(tail) + len(tail.rstrip(b" \t\n\r"))])
    return _VALUE.decode(view[start:end])  # a long run of blanks: msgspec trims them


def _blank(content: bytes, i: int) -> int:
    """Where the blanks (JSON whitespace) from ``i`` end."""
    return _BLANK.match(content, i).end()  # type: ignore[union-attr]


def _every_key(data: dict[str, Any]) -> Body:
    """What :func:`parse` makes of the stdlib parser's object: its values written anew."""
    return {_text(key): msgspec.Raw(_json_bytes(value)) for key, value in data.items()}


def _loads(content: bytes) -> Any:
    """``content`` built by the stdlib parser (JSON only: no NaN or Infinity); BodyError."""
    try:
        return json.loads(content, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError("is not JSON: nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError among them
        raise BodyError(f"is not JSON: {exc}") from None


def _text(key: str) -> str:
    """``key`` if UTF-8 can carry it (a key, unlike a value, cannot go on escaped)."""
    try:
        key.encode()
    except UnicodeEncodeError:
        raise BodyError(f"has a key that is not text: {key!r}") from None
    return key


def _json_bytes(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON; ASCII-escaped where it holds a lone surrogate."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode()  # fmt: skip
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity; Python's parser would accept them."""
    raise ValueError(f"{name} is not a JSON value")
