"""Request and answer bodies as the proxy sees them: top-level keys over values kept as sent.

The proxy changes a few top-level fields of a client's body (``max_tokens``, ``stream``,
``kv_transfer_params``) and reads one field of a prefill's answer (``kv_transfer_params``).
Every other value is checked as JSON and passed on as the bytes that came (``msgspec.Raw``),
never built into Python objects. Built by the stdlib parser, a 32 MiB body of empty lists took
770 MB and 3.7 s of the proxy's one event loop; kept raw, no memory past the body and 0.06 s.
A body has at most ``jsonbody.MAX_KEYS`` top-level keys (a 400 past them), so its keys cannot
cost more than the body either.
The reading itself, and the few bodies of a lone surrogate escape that msgspec refuses, are
:mod:`kvxferd.api.jsonbody`'s (shared with the sim's front door).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvxferd.api.jsonbody import Body, parse

KV_TRANSFER_STUB: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill is told: compute the prompt, keep the KV for a remote decode to read."""

_STUB = msgspec.Raw(msgspec.json.encode(KV_TRANSFER_STUB))
_TRUE, _FALSE, _ONE = msgspec.Raw(b"true"), msgspec.Raw(b"false"), msgspec.Raw(b"1")
_DROPPED_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "n")
"""Fields the prefill does without. ``n``: the decode samples the n completions from one
prompt's KV; a vLLM prefill given ``n`` runs n requests, each holding its KV for a remote
decode, and answers one's ``kv_transfer_params``: the other holds waited out their lease."""


_ITEM_STARTS = b'"['
"""First bytes of a batch's items: prompts as strings or as token-id lists."""


def batch_size(body: Body) -> int:
    """How many prompts a completions body's ``prompt`` names: a list of strings or of
    token-id lists is a batch, anything else one (a list of token ids is one prompt; a value
    the backend cannot take is the backend's to refuse)."""
    raw = body.get("prompt")
    if raw is None or bytes(memoryview(raw)[:1]) != b"[":
        return 1
    head = bytes(memoryview(raw)[1:4097]).lstrip()  # token ids: no list built for them
    if head and head[0] not in _ITEM_STARTS:
        return 1
    return len(msgspec.json.decode(raw, type=list[msgspec.Raw]))


def encode(body: Body) -> bytes:
    """``body`` as JSON: its values' own bytes, in its key order."""
    return msgspec.json.encode(body)


def streams(body: Body) -> bool:
    """Whether the client asked for an SSE stream (``"stream": true``)."""
    return body.get("stream") == _TRUE


def prefill_body(body: Body, chat: bool) -> Body:
    """The prefill's copy of a request: one token, one sequence, no streaming, the transfer
    stub."""
    out = dict(body)  # the values are shared, never changed
    out["kv_transfer_params"] = _STUB
    out["stream"] = _FALSE
    out["max_tokens"] = _ONE
    if chat:
        out["max_completion_tokens"] = _ONE
    for key in _DROPPED_FOR_PREFILL:
        out.pop(key, None)
    return out


def decode_body(body: Body, params: msgspec.Raw) -> Body:
    """The decode's copy of a request: the client's, with the prefill's transfer params."""
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def release_body(params: msgspec.Raw) -> Body:
    """What asks a prefill to free what it holds under ``params``."""
    return {"kv_transfer_params": params}


def transfer_params(content: bytes) -> msgspec.Raw | None:
    """The ``kv_transfer_params`` of a prefill's answer if it is a JSON object (None if it has
    none or another value); BodyError when the answer is not a JSON object."""
    params = parse(content).get("kv_transfer_params")
    if params is None or bytes(memoryview(params)[:1]) != b"{":
        return None
    return params
