"""Serve the proxy with uvicorn on a socket we bind (port 0 = any free), then print the ready line
``kvxferd proxy ready url=http://HOST:PORT`` so a parent process can find it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import uvicorn

from kvxferd.api.sockets import bind_tcp
from kvxferd.config import HTTP_SERVER_KEEPALIVE_S
from kvxferd.proxy.app import ProxySettings, proxy_app


class _Server(uvicorn.Server):
    """uvicorn.Server whose SIGINT/SIGTERM we handle, so a stop request exits 0 (not 130)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


async def serve_proxy(settings: ProxySettings, host: str, port: int, log_level: str) -> None:
    """Run until SIGINT/SIGTERM, then finish in-flight requests; the ready line goes to stdout."""
    sock = bind_tcp(host, port, "--port")
    bound_host, bound_port = sock.getsockname()[:2]
    server = _Server(
        uvicorn.Config(
            proxy_app(settings),
            log_level=log_level.lower(),
            access_log=False,
            timeout_keep_alive=HTTP_SERVER_KEEPALIVE_S,
        )
    )
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
