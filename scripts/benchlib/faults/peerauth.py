"""How the tools authenticate to a peer API, in one place: as a peer sidecar does, with a KVX1
signature (the secret never goes on the wire)."""

from __future__ import annotations

import time

from kvxferd.sidecar.signing import DEFAULT_SKEW_S, PeerKeys, sign_request

AHEAD_S = DEFAULT_SKEW_S - 1.0
"""Signed this far ahead of now: a sidecar refuses any ts before its start plus its skew
allowance (a restart forgets the nonces it saw), and the tools call sidecars they started a
moment ago; inside the default window of any sidecar started about 2 s before or more (our own
client instead signs again at the ``not_before`` a 401 names)."""


def peer_headers(method: str, path: str, body: bytes, secret: str) -> dict[str, str]:
    """Headers that authenticate one peer-API request (``body`` as sent)."""
    auth = sign_request(PeerKeys.of(secret), method, path, body, now=time.time() + AHEAD_S)
    return {"Authorization": auth}
