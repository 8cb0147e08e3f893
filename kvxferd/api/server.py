"""Run a sidecar: the engine API on a Unix socket (0600) and the peer API on TCP, one loop; the
engine API also as frames on a second Unix socket (0600, kvxferd.api.frames) and the peer API's
per-pull calls as signed frames on a second TCP port, unless they are off.

Each API is its own uvicorn server with its own connection cap; both bound header and body sizes
and read times (kvxferd.api.limits). Each API's HTTP and frames listeners share one body budget
(kvxferd.api.bodybudget): the bytes of request bodies and frame payloads it holds at once.

We bind both sockets ourselves (uvicorn would make the Unix socket 0666) and handle SIGINT and
SIGTERM once for both servers. When both listen, one line goes to stdout:
``kvxferd ready engine_socket=PATH peer=HOST:PORT engine_id=ID epoch=N`` (and
``frames_socket=PATH`` / ``peer_frames=HOST:PORT`` when the framed APIs are served).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI

from kvxferd.aio import http_parser, loop_name
from kvxferd.api.bodybudget import BodyBudget
from kvxferd.api.engine import OPERATIONS as ENGINE_OPERATIONS
from kvxferd.api.engine import engine_app
from kvxferd.api.fdbudget import ensure_fd_budget
from kvxferd.api.frames import FrameLimits, FrameServer
from kvxferd.api.limits import BodyLimit, EdgeLimits, uvicorn_limits
from kvxferd.api.operations import Gate
from kvxferd.api.peer import FRAME_OPERATIONS as PEER_FRAME_OPERATIONS
from kvxferd.api.peer import peer_app, peer_gate
from kvxferd.api.sockets import bind_tcp, bind_unix, lock_socket_path
from kvxferd.config import HTTP_SERVER_KEEPALIVE_S, Config
from kvxferd.sidecar.service import Sidecar

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to us (two servers share one process)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def edge_limits(config: Config, listener: str) -> EdgeLimits:
    """The limits of the ``engine`` or ``peer`` listener: separate connection caps, shared sizes
    and timeouts."""
    cap = config.engine_max_connections if listener == "engine" else config.peer_max_connections
    return EdgeLimits(
        max_connections=cap,
        max_header_bytes=config.max_header_bytes,
        max_body_bytes=config.max_body_bytes,
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        http=config.http,
        max_body_bytes_in_flight=config.max_body_bytes_in_flight,
    )


def body_budgets(config: Config, sidecar: Sidecar) -> dict[str, BodyBudget]:
    """One body budget per API (``engine``, ``peer``), shared by its HTTP and frames listeners
    and shown as ``kvxferd_request_body_bytes{api}``."""
    gauge = sidecar.metrics.request_body_bytes
    return {
        api: BodyBudget(config.max_body_bytes_in_flight, gauge.labels(api).set)
        for api in ("engine", "peer")
    }


def _uvicorn_config(
    config: Config, app: FastAPI, listener: str, budget: BodyBudget
) -> uvicorn.Config:
    """One listener's uvicorn server: its own app, connection cap and edge limits, and its
    API's body budget."""
    limits = edge_limits(config, listener)
    return uvicorn.Config(
        BodyLimit.of(app, limits, budget=budget),
        log_level=config.log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_keep_alive=HTTP_SERVER_KEEPALIVE_S,
        timeout_graceful_shutdown=config.shutdown_grace_s,
        **uvicorn_limits(limits, listener),
    )


def frame_limits(config: Config) -> FrameLimits:
    """The limits of the frames listener: the engine socket's connection cap and sizes (a frame
    may hold the largest body plus its envelope) and its timeouts."""
    return FrameLimits(
        max_connections=config.engine_max_connections,
        max_frame_bytes=config.max_body_bytes + config.max_header_bytes,
        idle_timeout_s=HTTP_SERVER_KEEPALIVE_S,
        frame_timeout_s=config.body_timeout_s,
        max_bytes_in_flight=config.max_body_bytes_in_flight,
    )


def peer_frame_limits(config: Config) -> FrameLimits:
    """The limits of the framed peer listener: the peer port's connection cap, sizes and
    timeouts."""
    return dataclasses.replace(frame_limits(config), max_connections=config.peer_max_connections)


def listener_limits(config: Config) -> list[EdgeLimits]:
    """Every listener's connection cap and backlog, for the open-file budget."""
    listeners = [edge_limits(config, "engine"), edge_limits(config, "peer")]
    framed = [(config.frames_socket, frame_limits(config), 0),
              (config.peer_frames_port >= 0, peer_frame_limits(config), 1)]  # fmt: skip
    for served, frames, like in framed:
        if served:
            listeners.append(dataclasses.replace(
                listeners[like], max_connections=frames.max_connections, backlog=frames.backlog
            ))  # fmt: skip
    return listeners


def _bind_frames(config: Config) -> tuple[socket.socket | None, socket.socket | None]:
    """The framed listeners' sockets (engine: Unix, 0600; peer: TCP on the peer host), None for
    one that is off."""
    engine = peer = None
    try:
        if config.frames_socket:
            engine = bind_unix(config.frames_socket, field="engine_frames_socket")
        if config.peer_frames_port >= 0:
            peer = bind_tcp(config.peer_host, config.peer_frames_port, field="peer_frames_port")
    except BaseException:
        if engine is not None:
            engine.close()
            os.unlink(config.frames_socket)
        raise
    return engine, peer


async def serve(config: Config) -> None:
    """Run until SIGINT/SIGTERM; then stop accepting, finish, release everything. The Unix
    socket paths stay locked until then: a second sidecar on them is refused."""
    locks = [lock_socket_path(config.engine_socket)]
    try:
        if config.frames_socket:
            locks.append(lock_socket_path(config.frames_socket, "engine_frames_socket"))
        ensure_fd_budget(listener_limits(config))
        log.info("event loop: %s, http: %s", loop_name(config.event_loop), http_parser(config.http))
        await _serve(config)
    finally:
        for fd in locks:
            os.close(fd)


async def _serve(config: Config) -> None:
    engine_sock = bind_unix(config.engine_socket)
    try:
        peer_sock = bind_tcp(config.peer_host, config.peer_port)
    except BaseException:
        engine_sock.close()
        os.unlink(config.engine_socket)
        raise
    try:
        frames_sock, peer_frames_sock = _bind_frames(config)
    except BaseException:
        engine_sock.close()
        peer_sock.close()
        os.unlink(config.engine_socket)
        raise
    sidecar = Sidecar(config)
    port = peer_sock.getsockname()[1]
    sidecar.peer_address = f"{config.advertised_host}:{port}"
    if peer_frames_sock is not None:
        sidecar.frames_port = peer_frames_sock.getsockname()[1]
    gate = peer_gate(sidecar)  # one verifier (nonces) for both peer listeners
    budgets = body_budgets(config, sidecar)
    servers = [
        (_Server(_uvicorn_config(config, engine_app(sidecar), "engine", budgets["engine"])),
         engine_sock),
        (_Server(_uvicorn_config(config, peer_app(sidecar, gate), "peer", budgets["peer"])),
         peer_sock),
    ]  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sidecar.start()
    frames: FrameServer | None = None
    peer_frames: FrameServer | None = None
    tasks = [asyncio.create_task(srv.serve(sockets=[sock])) for srv, sock in servers]
    try:
        if frames_sock is not None:
            engine_gate = Gate(ready=lambda: sidecar.ready)
            frames = FrameServer(ENGINE_OPERATIONS, sidecar, engine_gate, frame_limits(config),
                                 budgets["engine"])  # fmt: skip
            await frames.start(frames_sock)
        if peer_frames_sock is not None:
            peer_frames = FrameServer(
                PEER_FRAME_OPERATIONS, sidecar, gate, peer_frame_limits(config), budgets["peer"]
            )
            await peer_frames.start(peer_frames_sock)
        while not all(srv.started for srv, _ in servers):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.01)
        # What start-up made (modules, apps, the NIXL agent) lives as long as the process: out
        # of the collector's reach, a full collection no longer stalls the loop for tens of ms
        # mid-pull (scripts/bench_pulls.py --profile, issue 11).
        gc.freeze()
        print(
            f"kvxferd ready engine_socket={config.engine_socket} peer={sidecar.peer_address} "
            f"engine_id={sidecar.engine_id} epoch={sidecar.epoch}"
            + (f" frames_socket={config.frames_socket}" if frames is not None else "")
            + (
                f" peer_frames={config.advertised_host}:{sidecar.frames_port}"
                if peer_frames is not None
                else ""
            ),  # fmt: skip
            flush=True,
        )
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    finally:
        # One grace for everything still running (calls on every listener, store copies), not
        # one after another: SIGTERM ends the process within it plus the teardown.
        grace = config.shutdown_grace_s
        sidecar.offload.begin_shutdown(time.monotonic() + grace)
        for srv, _ in servers:
            srv.should_exit = True
        await asyncio.gather(*(f.close(grace) for f in (frames, peer_frames) if f is not None))
        if peer_frames_sock is not None:
            peer_frames_sock.close()
        if frames_sock is not None:
            frames_sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config.frames_socket)
        await asyncio.gather(*tasks, return_exceptions=True)
        await sidecar.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        engine_sock.close()
        peer_sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.engine_socket)
        print("kvxferd stopped", file=sys.stderr, flush=True)
        # Store I/O a hung disk holds would hold exit up for good: end at once then (with its
        # own status; the kernel drops the socket locks with us). Else nothing changes.
        sidecar.offload.exit_if_stuck()
