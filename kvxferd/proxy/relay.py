"""The proxy's relay of a streamed decode answer (SSE): events go on to the client as each is
whole, and a stream that breaks ends with the proxy's error event, never inside a cut one.

An answer without Content-Length or chunked framing ends when the decode closes its connection,
so a close is not by itself a clean end: such a stream that closes inside an event was cut (the
decode died, or its connection did), and ends with the error event as a cut chunked one does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx

from kvxferd.proxy.failures import BACKEND_ERRORS, BackendTimeout, describe_failure
from kvxferd.proxy.routing import Backend

log = logging.getLogger(__name__)

HELD_EVENT_BYTES = 64 << 10
"""Most bytes of an SSE event held back until it is whole; a longer one is relayed as it comes."""
_BLANK_LINES = (b"\n\n", b"\r\r", b"\r\n\r\n")
"""What ends an SSE event, by the line ends a stream uses (LF, CR or CRLF)."""


async def chunks(resp: httpx.Response, idle: float) -> AsyncIterator[bytes]:
    """The response's body chunks as they come; TimeoutError after ``idle`` s of silence."""
    body = resp.aiter_bytes()
    while True:
        try:
            async with asyncio.timeout(idle):
                chunk = await anext(body)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise BackendTimeout("next chunk", idle) from None
        yield chunk


def ends_at_close(resp: httpx.Response) -> bool:
    """The answer's body has no length of its own (neither Content-Length nor chunked): it ends
    where the backend closes the connection, cleanly or not."""
    return "content-length" not in resp.headers and "transfer-encoding" not in resp.headers


async def relay_events(
    resp: httpx.Response, decode: Backend, request_id: str, idle: float
) -> AsyncIterator[bytes]:
    """Relay the decode's SSE events as they come (never cut while bytes keep coming); a broken or
    silent (``idle`` s) stream ends with an SSE error event. An event goes on once whole (up to
    ``HELD_EVENT_BYTES``), so the error event never lands inside a cut one: a client's parser
    would read both as one broken event, and the OpenAI client raised a JSON error instead."""
    held = b""  # the start of an event not yet whole
    whole = True  # what went out ends where an event does
    try:
        async for chunk in chunks(resp, idle):  # decoded if the decode compressed
            if not held and chunk.endswith(b"\n\n"):  # the usual chunk: whole events
                yield chunk
                whole = True
                continue
            held += chunk
            end = events_end(held)
            if end:
                yield held[:end]
                held = held[end:]
            if len(held) > HELD_EVENT_BYTES:  # not SSE as we know it: relay it as it comes
                yield held
                held, whole = b"", False
            elif end:
                whole = True
        if (held or not whole) and ends_at_close(resp):
            held = b""  # the cut event is not relayed
            raise httpx.RemoteProtocolError("connection closed: the stream ended inside an event "
                                            "(an answer without a length ends at the close)",
                                            request=resp.request)  # fmt: skip
        if held:
            yield held
    except BACKEND_ERRORS as exc:
        reason = describe_failure(exc)
        log.warning("request %s: decode %s stream broke: %s", request_id, decode.url, reason)
        message = f"decode backend {decode.url} stream broke: {reason}"
        event = {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
        yield (b"" if whole else b"\n\n") + f"data: {json.dumps(event)}\n\n".encode()
    finally:
        await resp.aclose()


def events_end(data: bytes) -> int:
    """Where the last whole SSE event in ``data`` ends (after its blank line), 0 if none does."""
    ends = (data.rfind(sep) + len(sep) for sep in _BLANK_LINES if sep in data)
    return max(ends, default=0)


__all__ = ["HELD_EVENT_BYTES", "chunks", "ends_at_close", "events_end", "relay_events"]
