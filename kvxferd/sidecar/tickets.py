"""Sign and verify Tickets with HMAC-SHA256 keyed by the shared peer secret.

A ticket travels through the engines and the proxy (untrusted hands) before a decode sidecar
presents it to the prefill sidecar; the MAC makes any edit of its block ids, expiry or peer
detectable. The MAC covers every field except ``token``, encoded canonically as the msgspec JSON
of the ticket with ``token=""`` (fields in declaration order, floats in shortest round-trip form,
so a JSON round trip re-encodes to the same bytes).
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from kvxferd.errors import AuthError, ConfigError
from kvxferd.wire import Ticket

_encoder = msgspec.json.Encoder()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes | bytearray) or not secret:
        raise ConfigError("peer secret: must be non-empty bytes")


def ticket_mac(ticket: Ticket, secret: bytes) -> str:
    """Hex HMAC-SHA256 of the ticket's canonical bytes (its ``token`` ignored)."""
    _check_secret(secret)
    canonical = _encoder.encode(msgspec.structs.replace(ticket, token=""))
    return hmac.new(bytes(secret), canonical, hashlib.sha256).hexdigest()


def sign_ticket(ticket: Ticket, secret: bytes) -> Ticket:
    """A copy of ``ticket`` whose ``token`` is its MAC."""
    return msgspec.structs.replace(ticket, token=ticket_mac(ticket, secret))


def verify_ticket(ticket: Ticket, secret: bytes) -> None:
    """Raise AuthError unless ``ticket.token`` is the MAC of its other fields under ``secret``."""
    if not ticket.token:
        raise AuthError("ticket.token: missing")
    expected = ticket_mac(ticket, secret).encode("ascii")
    if not hmac.compare_digest(expected, ticket.token.encode("utf-8", "replace")):
        raise AuthError("ticket.token: does not match the ticket (tampered, or another secret)")
