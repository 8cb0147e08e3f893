"""OpenAI wire shapes of the simulated engine: request parsing, responses, SSE chunks, errors.

Parsing is strict where it matters to the engine (prompt, messages, max_tokens, stream,
kv_transfer_params) and names the offending field; unknown fields are ignored, as OpenAI-style
servers do. Responses carry ``kv_transfer_params`` at the top level, as vLLM's do.

Bodies come from anyone, up to 32 MiB: one is read by its top-level keys
(:mod:`kvxferd.api.jsonbody`), so an unknown field, or an unknown key of an object the sim reads,
is checked as JSON but never built. A known field is decoded as the type it must have and refused
at its first part that does not fit; a value where the sim reads a scalar is built only if it is
one. Built whole by the stdlib parser, a 32 MiB body of empty lists took 770 MB and 3.7 s of the
sim's one event loop.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvxferd.api import jsonbody
from kvxferd.api.jsonbody import BodyError, NotAnObjectError
from kvxferd.errors import InvalidRequestError, UnknownModelError
from kvxferd.sim.tokens import VOCAB_SIZE, chat_prompt, tokenize

Kind = Literal["completion", "chat"]
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS = 4096
_ABSENT = msgspec.Raw()  # a field the body does not have


@dataclass(frozen=True)
class ParsedRequest:
    """What the app needs from a completion or chat request body."""

    kind: Kind
    tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    """The keys of the body's params the sim reads (:class:`_Params`); None when it has none."""


class _Request(msgspec.Struct):
    """The top-level fields the sim reads, each as sent (empty: absent); others are skipped."""

    model: msgspec.Raw = _ABSENT
    n: msgspec.Raw = _ABSENT
    prompt: msgspec.Raw = _ABSENT
    messages: msgspec.Raw = _ABSENT
    stream: msgspec.Raw = _ABSENT
    stream_options: msgspec.Raw = _ABSENT
    kv_transfer_params: msgspec.Raw = _ABSENT
    max_tokens: msgspec.Raw = _ABSENT
    max_completion_tokens: msgspec.Raw = _ABSENT


class _StreamOptions(msgspec.Struct):
    """The one stream option the sim reads."""

    include_usage: msgspec.Raw = _ABSENT


class _Params(msgspec.Struct):
    """The keys of ``kv_transfer_params`` the sim reads (the engine through
    ``kvxferd.wire.transfer_params``, and its ``give_up``); others are skipped, never built."""

    do_remote_decode: msgspec.Raw = _ABSENT
    do_remote_prefill: msgspec.Raw = _ABSENT
    remote_request_id: msgspec.Raw = _ABSENT
    kvxferd_tickets: msgspec.Raw = _ABSENT


class _Part(msgspec.Struct):
    """A part of a chat message's content: text only."""

    type: Literal["text"]
    text: str


class _Message(msgspec.Struct):
    """A chat message (its other keys, such as a name or tool calls, skipped unbuilt)."""

    role: str
    content: str | None | list[_Part] = None


class _NoKeys(msgspec.Struct, forbid_unknown_fields=True):
    """An empty JSON object: decoding one with a key stops at that key."""


SHOWN_BYTES = 64
"""How much of an unbuilt array or object an error message shows."""


class _Shown:
    """A non-empty JSON array or object where the sim reads a scalar: never built, shown (in an
    error message, by ``str`` or ``repr``) by the first ``SHOWN_BYTES`` of its text as sent."""

    __slots__ = ("text",)

    def __init__(self, raw: msgspec.Raw) -> None:
        head = bytes(memoryview(raw)[:SHOWN_BYTES]).decode(errors="replace")
        self.text = head if len(raw) <= SHOWN_BYTES else head + "..."

    def __repr__(self) -> str:
        return self.text


_REQUEST = msgspec.json.Decoder(_Request)
_OPTIONS = msgspec.json.Decoder(_StreamOptions)
_PARAMS = msgspec.json.Decoder(_Params)
_SCALAR = msgspec.json.Decoder(str | int | float | bool | None | tuple[()] | _NoKeys)
_ANY = msgspec.json.Decoder()
_MESSAGES = msgspec.json.Decoder(list[_Message])
_PROMPTS = (
    msgspec.json.Decoder(str | None),
    msgspec.json.Decoder(list[int | bool]),  # bools kept to be named by index, as before
    msgspec.json.Decoder(tuple[str]),  # a one-element list: stops at a second element
    msgspec.json.Decoder(tuple[list[int | bool]]),
)
_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_MISSING = re.compile(r"missing required field `(?P<name>\w+)`")
_MESSAGE_AT = re.compile(
    r"\[(?P<i>\d+)\](?:\.(?P<key>role|content)(?:\[(?P<j>\d+)\](?:\.(?P<part>type|text))?)?)?"
)


def parse(kind: Kind, body: bytes, served_model: str) -> ParsedRequest:
    """Validate a request body; InvalidRequestError (UnknownModelError) names the field."""
    try:
        return _parse(kind, jsonbody.fields(body, _REQUEST), served_model)
    except BodyError as exc:
        raise InvalidRequestError("body", str(exc)) from None


def _parse(kind: Kind, req: _Request, served_model: str) -> ParsedRequest:
    model = _scalar(req.model)
    if model is not None and model != served_model:
        raise UnknownModelError("model", f"the model `{model}` does not exist (serving "
                                f"`{served_model}`)")  # fmt: skip
    if _scalar(req.n, 1) != 1:
        raise InvalidRequestError("n", "only n=1 is supported")
    if kind == "completion":
        tokens = _prompt_tokens(req.prompt)
    else:
        tokens = tokenize(_chat_text(req.messages))
    stream = _scalar(req.stream, False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream", "must be true or false")
    include_usage = _include_usage(req.stream_options)
    params = _params(req.kv_transfer_params)
    return ParsedRequest(
        kind=kind,
        tokens=tokens,
        max_tokens=_max_tokens(req, kind),
        stream=stream,
        include_usage=include_usage,
        kv_transfer_params=params,
    )


def raw_transfer_params(body: bytes) -> Any:
    """The ``kv_transfer_params`` of a body that may be invalid otherwise (None if unreadable):
    a refused request may still carry tickets whose holds should be declined."""
    try:
        return _params(jsonbody.fields(body, _REQUEST).kv_transfer_params)
    except (BodyError, InvalidRequestError):
        return None


def release_params(body: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a ``/v1/kv/release`` body (InvalidRequestError if none)."""
    try:
        params = _params(jsonbody.fields(body, _REQUEST).kv_transfer_params)
    except NotAnObjectError:
        params = None
    except BodyError as exc:
        raise InvalidRequestError("body", str(exc)) from None
    except InvalidRequestError:  # params that are not an object
        params = None
    if params is None:
        raise InvalidRequestError(
            "kv_transfer_params", "required: the object the prefill answered with"
        )
    return params


def _scalar(raw: msgspec.Raw, absent: Any = None) -> Any:
    """A value the sim reads as a scalar, as the stdlib parser builds it (``absent`` when the
    field is); a non-empty array or object stays unbuilt, as a :class:`_Shown`."""
    if not raw:
        return absent
    try:
        value = jsonbody.value(raw, _SCALAR)
    except msgspec.ValidationError:
        return _Shown(raw)
    if isinstance(value, tuple):
        return []
    return {} if isinstance(value, _NoKeys) else value


def _include_usage(raw: msgspec.Raw) -> bool:
    """``stream_options.include_usage`` as a truth value; a false-like ``stream_options`` (null,
    false, 0, "", []) is none, as before."""
    if not raw:
        return False
    try:
        options = jsonbody.fields(raw, _OPTIONS)
    except NotAnObjectError:
        if _scalar(raw):
            raise InvalidRequestError("stream_options", "must be an object") from None
        return False
    return bool(_scalar(options.include_usage))


def _params(raw: msgspec.Raw) -> dict[str, Any] | None:
    """The keys of ``kv_transfer_params`` the sim reads: the tickets built, the flags and the
    request id as :func:`_scalar` reads them (None when absent or null)."""
    try:
        params = jsonbody.fields(raw, _PARAMS) if raw else None
    except NotAnObjectError:
        if _scalar(raw) is None:
            return None
        raise InvalidRequestError("kv_transfer_params", "must be an object or null") from None
    if params is None:
        return None
    out: dict[str, Any] = {}
    for name in params.__struct_fields__:
        value = getattr(params, name)
        if value:
            out[name] = jsonbody.value(value, _ANY) if name == "kvxferd_tickets" else _scalar(value)
    return out


def _max_tokens(req: _Request, kind: Kind) -> int:
    field, value = "max_tokens", _scalar(req.max_tokens)
    if kind == "chat":
        completion = _scalar(req.max_completion_tokens)
        if completion is not None:
            field, value = "max_completion_tokens", completion
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise InvalidRequestError(field, f"must be an integer in [1, {MAX_TOKENS}], got {value!r}")
    return value


def _prompt_tokens(raw: msgspec.Raw) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a list holding one of those; each
    form is tried in turn and given up at its first element that does not fit."""
    required = InvalidRequestError("prompt", "required (a string or a list of token ids)")
    misfit = InvalidRequestError("prompt", "must be a string or a non-empty list of token ids "
                                 "(one prompt per request)")  # fmt: skip
    if not raw:
        raise required
    for decoder in _PROMPTS:
        try:
            prompt = jsonbody.value(raw, decoder)
        except msgspec.ValidationError:
            continue
        break
    else:
        raise misfit
    if prompt is None:
        raise required
    if isinstance(prompt, tuple):
        (prompt,) = prompt
    if isinstance(prompt, str):
        return tokenize(prompt)
    if not prompt:
        raise misfit
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
            raise InvalidRequestError(f"prompt[{i}]", f"token id {t!r} outside the vocabulary")
    return prompt


def _chat_text(raw: msgspec.Raw) -> str:
    required = InvalidRequestError("messages", "required: a non-empty list of messages")
    if not raw:
        raise required
    try:
        messages = jsonbody.value(raw, _MESSAGES)
    except msgspec.ValidationError as exc:
        raise _message_error(str(exc)) or required from None
    if not messages:
        raise required
    return chat_prompt([(msg.role, _content(msg.content)) for msg in messages])


def _content(content: str | list[_Part] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


def _message_error(error: str) -> InvalidRequestError | None:
    """The error for the first message part that did not fit (msgspec's ``error`` names its path,
    or the message missing a key); None where the messages are not a list."""
    match = _AT.match(error)
    assert match is not None  # every string matches
    path = match["path"]
    missing = _MISSING.search(match["message"])
    if path is not None and missing:
        path += f".{missing['name']}"
    at = _MESSAGE_AT.fullmatch(path or "")
    if at is None:
        return None
    i, j = at["i"], at["j"]
    if at["key"] in (None, "role"):
        return InvalidRequestError(f"messages[{i}].role", "each message needs a string role")
    if j is None:
        return InvalidRequestError(
            f"messages[{i}].content", "must be a string or a list of text parts"
        )
    if at["part"] == "text":
        return InvalidRequestError(f"messages[{i}].content[{j}].text", "must be a string")
    return InvalidRequestError(f"messages[{i}].content[{j}]", "only text parts are supported")


# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the engine produced for one request, ready to be shaped for the wire."""

    kind: Kind
    model: str
    tokens: list[str]
    prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: Kind, model: str, tokens: list[str], prompt_tokens: int,
            kv_transfer_params: dict[str, Any] | None = None) -> Reply:  # fmt: skip
        """A reply with a fresh id and the current time."""
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        return cls(kind, model, tokens, prompt_tokens, kv_transfer_params,
                   f"{prefix}-{uuid.uuid4().hex}", int(time.time()))  # fmt: skip

    def usage(self) -> dict[str, int]:
        """OpenAI usage block."""
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n}  # fmt: skip

    def body(self) -> dict[str, Any]:
        """The non-streaming response object."""
        text = "".join(self.tokens)
        if self.kind == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}  # fmt: skip
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}  # fmt: skip
            obj = "chat.completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": [choice], "usage": self.usage()}  # fmt: skip
        if self.kv_transfer_params is not None:
            out["kv_transfer_params"] = self.kv_transfer_params
        return out

    def chunks(self, include_usage: bool) -> Iterator[bytes]:
        """Server-sent events: one chunk per token, a final one, usage if asked, [DONE]."""
        if self.kind == "chat":
            yield self._event({"role": "assistant", "content": ""}, None)
        for tok in self.tokens:
            yield self._event({"content": tok} if self.kind == "chat" else tok, None)
        yield self._event({} if self.kind == "chat" else "", "length", final=True)
        if include_usage:
            yield _sse({**self._head(), "choices": [], "usage": self.usage()})
        yield b"data: [DONE]\n\n"

    def _head(self) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _event(self, piece: Any, finish: str | None, final: bool = False) -> bytes:
        key = "delta" if self.kind == "chat" else "text"
        choice = {"index": 0, key: piece, "logprobs": None, "finish_reason": finish}
        out = {**self._head(), "choices": [choice]}
        if final and self.kv_transfer_params is not None:
            out["kv_transfer_params"] = self.kv_transfer_params
        return _sse(out)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 502: "bad_gateway",
               503: "service_unavailable", 500: "internal_error"}  # fmt: skip


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object."""
    kind = ERROR_TYPES.get(status, "error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
