"""The peer-facing API (TCP, bearer token): handshake, claim, heartbeat; plus metrics and probes."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import make_asgi_app

from kvxferd.api.codec import HTTPProblem, StructResponse, decode
from kvxferd.api.engine import _install_error_handlers
from kvxferd.wire import ClaimRequest, ErrorBody, Handshake, Heartbeat

if TYPE_CHECKING:
    from kvxferd.sidecar.service import Sidecar


def peer_app(sidecar: Sidecar) -> FastAPI:
    """The FastAPI app other sidecars talk to; /metrics, /healthz and /readyz need no token."""
    app = FastAPI(title="kvxferd peer API", version="1", default_response_class=StructResponse)
    _install_error_handlers(app)
    secret = sidecar.config.peer_token.encode()

    def authorize(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not secret or not hmac.compare_digest(given.encode(), b"Bearer " + secret):
            raise HTTPProblem(
                401, ErrorBody(error="AuthError", detail="missing or wrong bearer token")
            )

    @app.post("/v1/handshake")
    async def handshake(request: Request) -> Response:
        """Exchange protocol version, manifest and NIXL metadata; 409 lists disagreeing fields."""
        authorize(request)
        return StructResponse(await sidecar.accept_handshake(await decode(request, Handshake)))

    @app.post("/v1/claims")
    async def claim(request: Request) -> Response:
        """Pin a hold before reading it; 404 unknown, 410 expired."""
        authorize(request)
        return StructResponse(sidecar.claim(await decode(request, ClaimRequest)))

    @app.post("/v1/heartbeat")
    async def heartbeat(request: Request) -> Response:
        """Extend the leases of holds whose requests are still queued on the decode side."""
        authorize(request)
        return StructResponse(sidecar.heartbeat(await decode(request, Heartbeat)))

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return StructResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness: an engine has registered its memory and the NIXL agent is up."""
        ready = sidecar.ready
        return StructResponse({"ready": ready}, status_code=200 if ready else 503)

    app.mount("/metrics", make_asgi_app(sidecar.metrics.registry))
    return app
