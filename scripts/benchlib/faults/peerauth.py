"""How the campaign authenticates to a peer API, in one place: as a peer sidecar does, with a
KVX1 signature (the secret never goes on the wire)."""

from __future__ import annotations

from kvxferd.sidecar.signing import PeerKeys, sign_request


def peer_headers(method: str, path: str, body: bytes, secret: str) -> dict[str, str]:
    """Headers that authenticate one peer-API request (``body`` as sent)."""
    return {"Authorization": sign_request(PeerKeys.of(secret), method, path, body)}
