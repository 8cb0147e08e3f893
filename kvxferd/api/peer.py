"""The peer-facing API (TCP, bearer token): handshake, claim, heartbeat; plus metrics and probes."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from prometheus_client import make_asgi_app
from starlette.routing import Route

from kvxferd.api.codec import HTTPProblem, StructResponse
from kvxferd.api.openapi import HEALTH, document, install_openapi
from kvxferd.api.operations import Gate, Operation, mount
from kvxferd.wire import (
    ClaimRequest,
    ClaimResponse,
    ErrorBody,
    Handshake,
    Heartbeat,
    HeartbeatResponse,
)

if TYPE_CHECKING:
    from kvxferd.sidecar.service import Sidecar

TITLE = "kvxferd peer API"
DESCRIPTION = (
    "What sidecars ask of each other, over TCP: handshake (once per engine id and epoch), "
    "claim a hold before reading its blocks with NIXL, and heartbeat leases of queued requests. "
    "Every /v1 call needs 'Authorization: Bearer <shared peer secret>'; /healthz, /readyz and "
    "/metrics need none. Every 4xx/5xx body is an ErrorBody."
)
READY = {
    "type": "object",
    "properties": {"ready": {"const": True, "description": "An engine has registered."}},
    "required": ["ready"],
}
METRICS = {"type": "string", "description": "Prometheus text exposition format."}


async def handshake(sidecar: Sidecar, req: Handshake) -> Handshake:
    """Exchange protocol version, manifest and NIXL agent metadata; answers with ours.

    The protocol version is checked first. A 409 lists every field that keeps the two manifests
    from exchanging blocks (``field`` is their comma-separated list).
    """
    return await sidecar.accept_handshake(req)


async def claim(sidecar: Sidecar, req: ClaimRequest) -> ClaimResponse:
    """Pin a hold while the caller reads it; 404 unknown hold, 410 expired (never readable).

    The ticket's HMAC is checked (401 when it does not match). The claim lasts ``claim_s``
    (capped); the hold is released once every expected reader has sent its NIXL notification.
    """
    return sidecar.claim(req)


async def heartbeat(sidecar: Sidecar, req: Heartbeat) -> HeartbeatResponse:
    """Extend the leases of holds whose requests are still queued on the decode side."""
    return sidecar.heartbeat(req)


async def healthz(sidecar: Sidecar) -> dict[str, Any]:
    """Liveness: the process answers (no token)."""
    return {"status": "ok"}


async def readyz(sidecar: Sidecar) -> dict[str, Any]:
    """Readiness: an engine has registered its memory with the NIXL agent (no token)."""
    return {"ready": True}


OPERATIONS = [
    Operation("POST", "/v1/handshake", handshake, Handshake, Handshake,
              errors=(400, 401, 409, 422, 500, 503), auth=True, needs_engine=True),
    Operation("POST", "/v1/claims", claim, ClaimRequest, ClaimResponse,
              errors=(400, 401, 404, 410, 422, 500, 503), auth=True, needs_engine=True),
    Operation("POST", "/v1/heartbeat", heartbeat, Heartbeat, HeartbeatResponse,
              errors=(400, 401, 422, 500, 503), auth=True, needs_engine=True),
    Operation("GET", "/healthz", healthz, None, HEALTH),
    Operation("GET", "/readyz", readyz, None, READY, errors=(503,), needs_engine=True),
    Operation("GET", "/metrics", None, None, METRICS, media_type="text/plain", name="metrics",
              doc="Prometheus metrics of this sidecar (no token)."),
]  # fmt: skip
"""The route table: served by peer_app, documented by peer_document."""


def bearer_check(token: str) -> Callable[[Request], None]:
    """A Gate.authorize accepting exactly ``Authorization: Bearer <token>`` (never when empty)."""
    secret = token.encode()

    def authorize(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), secret)
        if not secret or not ok:
            body = ErrorBody(error="AuthError", detail="missing or wrong bearer token")
            raise HTTPProblem(401, body)

    return authorize


def peer_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the peer API."""
    return document(TITLE, DESCRIPTION, OPERATIONS)


class _Asgi:
    """An ASGI app as a Route endpoint (a Mount would redirect /metrics to /metrics/)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def peer_app(sidecar: Sidecar) -> FastAPI:
    """The FastAPI app other sidecars talk to; /metrics, /healthz and /readyz need no token."""
    app = FastAPI(title=TITLE, version="1", default_response_class=StructResponse)
    gate = Gate(ready=lambda: sidecar.ready, authorize=bearer_check(sidecar.config.peer_token))
    mount(app, OPERATIONS, sidecar, gate)
    app.router.routes.append(
        Route("/metrics", _Asgi(make_asgi_app(sidecar.metrics.registry)), methods=["GET"])
    )
    install_openapi(app, peer_document)
    return app
