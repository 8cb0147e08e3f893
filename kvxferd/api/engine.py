"""The engine-facing API (Unix socket, local only): register, hold, abort, pull, released feed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvxferd.api.codec import HTTPProblem, StructResponse, decode, problem_response
from kvxferd.errors import KvxferdError
from kvxferd.wire import AbortHoldRequest, HoldRequest, PullRequest, RegisterRequest

if TYPE_CHECKING:
    from kvxferd.sidecar.service import Sidecar

MAX_WAIT_S = 60.0
"""Upper bound of a pull-status long poll."""


def engine_app(sidecar: Sidecar) -> FastAPI:
    """The FastAPI app an engine rank talks to."""
    app = FastAPI(title="kvxferd engine API", version="1", default_response_class=StructResponse)
    _install_error_handlers(app)

    @app.post("/v1/register")
    async def register(request: Request) -> Response:
        """Register the engine's manifest and memory regions (once per sidecar epoch)."""
        return StructResponse(await sidecar.register(await decode(request, RegisterRequest)))

    @app.post("/v1/holds")
    async def hold(request: Request) -> Response:
        """Pin a prefilled request's blocks; returns the Ticket a decode side pulls with."""
        return StructResponse(sidecar.hold(await decode(request, HoldRequest)))

    @app.post("/v1/holds/abort")
    async def abort(request: Request) -> Response:
        """Give up a hold; its blocks show up in the released feed."""
        sidecar.abort(await decode(request, AbortHoldRequest))
        return Response(status_code=204)

    @app.post("/v1/pulls", status_code=202)
    async def pull(request: Request) -> Response:
        """Start reading a ticket's blocks into local blocks; returns a pull id."""
        accepted = await sidecar.start_pull(await decode(request, PullRequest))
        return StructResponse(accepted, status_code=202)

    @app.get("/v1/pulls/{pull_id}")
    async def pull_status(pull_id: str, wait: float = 0.0) -> Response:
        """A pull's state; ``wait`` long-polls (bounded) until it is done or failed."""
        return StructResponse(await sidecar.pull_status(pull_id, min(max(wait, 0.0), MAX_WAIT_S)))

    @app.get("/v1/released")
    async def released(cursor: int = 0) -> Response:
        """Holds released since ``cursor`` (notified, expired or aborted): free their blocks."""
        return StructResponse(sidecar.released_since(cursor))

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return StructResponse({"status": "ok"})

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every kvxferd error becomes its 4xx/5xx ErrorBody; nothing takes the daemon down."""

    async def handle(_: Request, exc: Exception) -> Response:
        return problem_response(exc)

    app.add_exception_handler(HTTPProblem, handle)
    app.add_exception_handler(KvxferdError, handle)
    app.add_exception_handler(Exception, handle)
