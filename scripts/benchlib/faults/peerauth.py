"""How the campaign authenticates to a peer API, in one place.

Today's peer API takes ``Authorization: Bearer <secret>``. Once peers sign requests (issue 10,
docs/api-design.md: ``Authorization: KVX1 key=..., ts=..., nonce=..., sig=...``), replace the
body of :func:`peer_headers` by one call to the project's signing helper.
"""

from __future__ import annotations


def peer_headers(method: str, path: str, body: bytes, secret: str) -> dict[str, str]:
    """Headers that authenticate one peer-API request (``body`` as sent)."""
    return {"Authorization": f"Bearer {secret}"}
