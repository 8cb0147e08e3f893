"""FastAPI apps whose hottest routes skip FastAPI's per-request machinery.

A request through FastAPI passes its middleware stack (server errors, exception handlers, the
exit stack), the router's scan and the endpoint's dependency solving: about 0.08 ms of the
proxy's CPU per request on these machines, paid by every request of the P/D path in the proxy
and again in the prefill sim (issue 11; ``scripts/bench_control.py`` prints the CPU by process).
A :class:`DirectApp` serves the routes registered with :meth:`DirectApp.post_direct` straight
from ``__call__`` with a starlette Request; everything else (other paths and methods, lifespan,
the OpenAPI document, which still lists the direct routes) goes through FastAPI as before.

A direct endpoint takes the Request and answers its own errors as responses. One that raises
anyway is logged and answered 500, as FastAPI's ServerErrorMiddleware would answer it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

DirectEndpoint = Callable[[Request], Awaitable[Response]]
"""An endpoint served directly: the request in, the whole response out."""


class DirectApp(FastAPI):
    """FastAPI, with the ``POST`` routes of :meth:`post_direct` served before its stack."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.direct: dict[tuple[str, str], DirectEndpoint] = {}
        """(method, exact path) to the endpoint that serves it directly."""

    def post_direct(self, path: str) -> Callable[[DirectEndpoint], DirectEndpoint]:
        """Register ``endpoint`` for ``POST path``: served directly, and listed as FastAPI's
        ``@app.post(path)`` would list it (other methods on ``path`` answer 405 as before)."""

        def register(endpoint: DirectEndpoint) -> DirectEndpoint:
            self.direct[("POST", path)] = endpoint
            return self.post(path)(endpoint)

        return register

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = (
            self.direct.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        )
        if endpoint is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # Request.app (and its state) as under FastAPI
        try:
            response = await endpoint(Request(scope, receive))
        except Exception:
            log.exception("%s %s failed unexpectedly", scope["method"], scope["path"])
            response = PlainTextResponse("Internal Server Error", status_code=500)
        await response(scope, receive, send)


__all__ = ["DirectApp", "DirectEndpoint"]
