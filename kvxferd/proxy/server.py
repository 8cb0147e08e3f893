"""Serve the proxy with uvicorn on a socket we bind (port 0 = any free), then print the ready line
``kvxferd proxy ready url=http://HOST:PORT`` so a parent process can find it.

The listener has the sidecar's edge limits (kvxferd.api.limits) sized for an OpenAI front door:
a connection cap, bounded heads and bodies (chat requests can be large), head and body read
timeouts; refusals are OpenAI-shaped error objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys

import uvicorn

from kvxferd.api.limits import BodyLimit, EdgeLimits, uvicorn_limits
from kvxferd.api.sockets import bind_tcp
from kvxferd.commands.edge import front_door_defaults
from kvxferd.config import HTTP_SERVER_KEEPALIVE_S
from kvxferd.proxy.app import ProxySettings, proxy_app

FRONT_DOOR_LIMITS = EdgeLimits(**front_door_defaults())
"""Defaults of an OpenAI-compatible listener (``kvxferd proxy``, ``kvxferd sim``)."""


def openai_error_body(status: int, error: str, detail: str) -> bytes:
    """A refusal at the edge as an OpenAI error object (``type`` is the refusal's name)."""
    body = {"error": {"message": detail, "type": error, "param": None, "code": status}}
    return json.dumps(body).encode()


def front_door_config(app: object, limits: EdgeLimits, name: str, **kw: object) -> uvicorn.Config:
    """The uvicorn config of an OpenAI-compatible listener: ``app`` behind ``limits``."""
    return uvicorn.Config(
        BodyLimit.of(app, limits, openai_error_body),  # type: ignore[arg-type]
        timeout_keep_alive=HTTP_SERVER_KEEPALIVE_S,
        access_log=False,
        **uvicorn_limits(limits, name),
        **kw,  # type: ignore[arg-type]
    )


class _Server(uvicorn.Server):
    """uvicorn.Server whose SIGINT/SIGTERM we handle, so a stop request exits 0 (not 130)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


async def serve_proxy(
    settings: ProxySettings, host: str, port: int, log_level: str,
    limits: EdgeLimits = FRONT_DOOR_LIMITS,
) -> None:  # fmt: skip
    """Run until SIGINT/SIGTERM, then finish in-flight requests; the ready line goes to stdout."""
    sock = bind_tcp(host, port, "--port")
    bound_host, bound_port = sock.getsockname()[:2]
    app = proxy_app(settings)
    server = _Server(front_door_config(app, limits, "proxy", log_level=log_level.lower()))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            print(f"kvxferd proxy ready url=http://{shown}:{bound_port}", flush=True)
        await task
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        sock.close()
        print("kvxferd proxy stopped", file=sys.stderr, flush=True)
