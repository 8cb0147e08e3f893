"""The framed protocol: the same operations as HTTP, on a second socket (engine: Unix; peer: TCP).

A frame is a 4-byte big-endian length followed by that many bytes of one MessagePack envelope.
A :class:`FrameRequest` names the operation as ``"METHOD /path"`` (the route table's method and
a concrete path, ``GET /v1/pulls/<id>``) and carries the body as the MessagePack of the same
Struct the HTTP route takes; the :class:`FrameAnswer` carries the same HTTP status and the same
answer Struct or ErrorBody. Requests on one connection carry distinct ids; answers come in any
order, each with its request's id. On the peer listener a request of a signed operation carries
its signature in ``auth`` (proto/README.md, "Signatures").
"""

from __future__ import annotations

from typing import Any

import msgspec

FRAME_HEADER = 4
"""Bytes of the length prefix of every frame (unsigned, big-endian)."""
NIL = msgspec.Raw(b"\xc0")
"""The MessagePack nil: the body of a request or answer without one."""


class FrameRequest(msgspec.Struct, frozen=True):
    """One call over frames (engine or peer API)."""

    id: int
    """Chosen by the client, distinct among its requests in flight on the connection."""
    op: str
    """``"METHOD /path"``, e.g. ``"POST /v1/pulls/run"`` or ``"GET /v1/pulls/<pull id>"``."""
    query: dict[str, Any] = {}
    """Query parameters of the operation (strings or their typed values)."""
    body: msgspec.Raw = NIL
    """MessagePack of the operation's request Struct (nil when it takes none)."""
    auth: str = ""
    """A signed operation's signature: the value HTTP sends as ``Authorization`` (``KVX1 ...``),
    computed over the method, the op's path and these exact body bytes; empty otherwise."""


class FrameAnswer(msgspec.Struct, frozen=True):
    """The answer to one FrameRequest."""

    id: int
    """The request's id."""
    status: int
    """The HTTP status the same call answers over HTTP (200, 202, 204, 4xx, 5xx)."""
    body: msgspec.Raw = NIL
    """MessagePack of the answer Struct, or of an ErrorBody when ``status`` >= 400; nil for
    204."""


def frame(payload: bytes) -> bytes:
    """``payload`` with its length prefix."""
    return len(payload).to_bytes(FRAME_HEADER, "big") + payload


def frame_length(header: bytes) -> int:
    """The payload length a 4-byte frame header announces."""
    return int.from_bytes(header, "big")
