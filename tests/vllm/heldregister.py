"""A real ``kvxferd serve`` whose registers the test holds in progress for as long as it needs.

Run as ``python -m tests.vllm.heldregister GATE serve ARGS...``: each register, once the sidecar
counts it in progress and before it maps anything, prints HELD and waits for a shared flock on
the file GATE; the test holds GATE exclusively (:func:`gate`) until it lets the registers go.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator

from kvxferd.sim.children import Child
from kvxferd.sim.sidecars import READY_TIMEOUT_S, serve_argv, wait_ready
from tests.sidecar.harness import TOKEN, Sidecar

HELD = "kvxferd test: register held"


@contextlib.contextmanager
def gate(path: str) -> Iterator[None]:
    """Hold the registers of a sidecar started with ``path`` until the block ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # lets every held register go on


def start_held_sidecar(tmp_dir: str, name: str, gate_path: str) -> Sidecar:
    """Start the sidecar ``name`` (socket ``tmp_dir/NAME.sock``) as the harness does, its
    registers held while ``gate_path`` is held; wait (bounded) for its ready line."""
    sock = os.path.join(tmp_dir, f"{name}.sock")
    argv = serve_argv(sock, "--log-level", "warning")
    argv[1:4] = ["-m", __name__, gate_path, "serve"]  # `-m kvxferd serve` through this module
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "KVXFERD_PEER_TOKEN": TOKEN,
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    return wait_ready(Child.spawn(name, argv, env=env, merge_stderr=True), sock, READY_TIMEOUT_S)


def _hold_registers(gate_path: str) -> None:
    from kvxferd.sidecar import service

    map_sources = service.map_sources

    async def held(*args: object) -> object:
        print(HELD, flush=True)
        await asyncio.to_thread(_wait_for, gate_path)
        return await map_sources(*args)  # type: ignore[arg-type]

    service.map_sources = held  # type: ignore[assignment]


def _wait_for(gate_path: str) -> None:
    fd = os.open(gate_path, os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # blocks while the test holds the gate
    finally:
        os.close(fd)


if __name__ == "__main__":
    from kvxferd.cli import main

    _hold_registers(sys.argv[1])
    raise SystemExit(main(sys.argv[2:]))
