"""OpenAI wire shapes of the simulated engine: request parsing, responses, SSE chunks, errors.

Parsing is strict where it matters to the engine (prompt, messages, max_tokens, stream,
kv_transfer_params) and names the offending field; unknown fields are ignored, as OpenAI-style
servers do. Responses carry ``kv_transfer_params`` at the top level, as vLLM's do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from kvxferd.errors import InvalidRequestError, UnknownModelError
from kvxferd.sim.tokens import VOCAB_SIZE, chat_prompt, tokenize

Kind = Literal["completion", "chat"]
DEFAULT_MAX_TOKENS = 16
MAX_TOKENS = 4096


@dataclass(frozen=True)
class ParsedRequest:
    """What the app needs from a completion or chat request body."""

    kind: Kind
    tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None


def parse(kind: Kind, body: bytes, served_model: str) -> ParsedRequest:
    """Validate a request body; InvalidRequestError (UnknownModelError) names the field."""
    data = _json(body)
    if not isinstance(data, dict):
        raise InvalidRequestError("body", f"expected a JSON object, got {type(data).__name__}")
    model = data.get("model")
    if model is not None and model != served_model:
        raise UnknownModelError("model", f"the model `{model}` does not exist (serving "
                                f"`{served_model}`)")  # fmt: skip
    if data.get("n", 1) != 1:
        raise InvalidRequestError("n", "only n=1 is supported")
    tokens = _prompt_tokens(data) if kind == "completion" else tokenize(_chat_text(data))
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream", "must be true or false")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options", "must be an object")
    params = data.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError("kv_transfer_params", "must be an object or null")
    return ParsedRequest(
        kind=kind,
        tokens=tokens,
        max_tokens=_max_tokens(data, kind),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        kv_transfer_params=params,
    )


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("body", "JSON nested too deeply") from None


def raw_transfer_params(body: bytes) -> Any:
    """The ``kv_transfer_params`` of a body that may be invalid otherwise (None if unreadable):
    a refused request may still carry tickets whose holds should be declined."""
    try:
        data = _json(body)
    except InvalidRequestError:
        return None
    return data.get("kv_transfer_params") if isinstance(data, dict) else None


def release_params(body: bytes) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a ``/v1/kv/release`` body (InvalidRequestError if none)."""
    data = _json(body)
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise InvalidRequestError(
            "kv_transfer_params", "required: the object the prefill answered with"
        )
    return params


def _max_tokens(data: dict[str, Any], kind: Kind) -> int:
    field = "max_tokens"
    value = data.get(field)
    if kind == "chat" and data.get("max_completion_tokens") is not None:
        field, value = "max_completion_tokens", data["max_completion_tokens"]
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKENS:
        raise InvalidRequestError(field, f"must be an integer in [1, {MAX_TOKENS}], got {value!r}")
    return value


def _prompt_tokens(data: dict[str, Any]) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a list holding one of those."""
    if "prompt" not in data or data["prompt"] is None:
        raise InvalidRequestError("prompt", "required (a string or a list of token ids)")
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not 0 <= t < VOCAB_SIZE:
                raise InvalidRequestError(f"prompt[{i}]", f"token id {t!r} outside the vocabulary")
        return list(prompt)
    raise InvalidRequestError("prompt", "must be a string or a non-empty list of token ids "
                              "(one prompt per request)")  # fmt: skip


def _chat_text(data: dict[str, Any]) -> str:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "required: a non-empty list of messages")
    turns = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidRequestError(f"messages[{i}].role", "each message needs a string role")
        turns.append((msg["role"], _content(msg.get("content"), f"messages[{i}].content")))
    return chat_prompt(turns)


def _content(content: Any, field: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(f"{field}[{j}]", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{field}[{j}].text", "must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(field, "must be a string or a list of text parts")


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
