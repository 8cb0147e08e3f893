"""JSON request bodies read by their top-level keys, each value kept as the bytes that came.

A front door (the proxy's, the sim's) takes bodies of up to 32 MiB from anyone. Built whole by
the stdlib parser, a 32 MiB body of empty lists took 770 MB and 3.7 s of one event loop. Here a
body is checked as JSON and split at its top-level keys, each value kept as sent
(``msgspec.Raw``, never built into objects): :func:`parse` keeps every key (the proxy passes them
on), :func:`fields` only the keys a Struct names (the others are skipped, not even their keys are
built), and :func:`value` decodes one kept value as a type, failing at its first part that does
not fit rather than after building all of it.

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

T = TypeVar("T")
_OBJECT = msgspec.json.Decoder(Body)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # escaped, as the writer leaves it


class BodyError(ValueError):
    """A body that cannot be read: not JSON, or not a JSON object."""


class NotAnObjectError(BodyError):
    """JSON, but not an object (some callers name another culprit for this one)."""


def parse(content: bytes) -> Body:
    """``content`` as a JSON object's top-level keys; BodyError saying what is wrong."""
    return _read(content, _OBJECT, _every_key)


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
