"""A DirectApp serves its direct routes without FastAPI's stack and everything else through it,
as FastAPI alone would (pure ASGI logic: starlette's TestClient, no sockets)."""

from __future__ import annotations

import logging

import pytest
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from kvxferd.api.direct import DirectApp


def _app() -> tuple[DirectApp, list[str]]:
    """An app with one direct route and one ordinary one; ``through`` lists the paths FastAPI's
    middleware stack saw."""
    app = DirectApp(title="t")
    app.state.greeting = "hello"
    through: list[str] = []

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]
        through.append(f"{request.method} {request.url.path}")
        return await call_next(request)

    @app.post_direct("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        return JSONResponse(
            {"echo": body, "state": request.app.state.greeting, "id": request.headers["x-id"]}
        )

    @app.post_direct("/v1/broken")
    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug in the endpoint")

    @app.post("/v1/other")
    async def other() -> dict[str, str]:
        return {"via": "fastapi"}

    return app, through


def test_a_direct_route_is_served_without_the_middleware_stack() -> None:
    app, through = _app()
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Id": "r1"})
    assert resp.status_code == 200
    assert resp.json() == {"echo": {"prompt": "x"}, "state": "hello", "id": "r1"}
    assert through == []


def test_other_paths_and_methods_go_through_fastapi() -> None:
    app, through = _app()
    with TestClient(app) as client:
        assert client.post("/v1/other").json() == {"via": "fastapi"}
        assert client.get("/v1/completions").status_code == 405  # only POST is direct
        slash = client.post("/v1/completions/", follow_redirects=False)
        assert slash.status_code == 307  # exact paths only: FastAPI redirects this one
        assert client.post("/nowhere").status_code == 404
    assert through[:3] == ["POST /v1/other", "GET /v1/completions", "POST /v1/completions/"]


def test_the_openapi_document_still_lists_the_direct_routes() -> None:
    app, _ = _app()
    paths = app.openapi()["paths"]
    assert "post" in paths["/v1/completions"] and "post" in paths["/v1/other"]


def test_a_direct_endpoint_that_raises_is_answered_500_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, _ = _app()
    with (
        caplog.at_level(logging.ERROR, logger="kvxferd.api.direct"),
        TestClient(app, raise_server_exceptions=False) as client,
    ):
        resp = client.post("/v1/broken")
        assert client.post("/v1/completions", json=1, headers={"X-Id": "r2"}).status_code == 200
    assert resp.status_code == 500 and resp.text == "Internal Server Error"
    assert "POST /v1/broken failed unexpectedly" in caplog.text
    assert "a bug in the endpoint" in caplog.text
