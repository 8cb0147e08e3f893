"""Start ``kvxferd serve`` children, one per engine rank, and wait (bounded) for their ready lines.

The ready line is ``kvxferd ready engine_socket=PATH peer=HOST:PORT engine_id=ID epoch=N``; its
fields become a :class:`SidecarProcess`. All ranks start at once and share one deadline.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvxferd.client import AsyncEngineClient, EngineClient
from kvxferd.errors import StartupError
from kvxferd.sim.children import Child

READY_PREFIX = "kvxferd ready"
READY_TIMEOUT_S = 60.0


@dataclass
class SidecarProcess:
    """A running ``kvxferd serve`` child and what its ready line said."""

    socket: str
    peer: str
    engine_id: str
    epoch: int
    child: Child

    def client(self, timeout_s: float = 30.0) -> EngineClient:
        """A blocking engine-API client on the sidecar's Unix socket."""
        return EngineClient(self.socket, timeout_s=timeout_s)

    def async_client(self, timeout_s: float = 30.0) -> AsyncEngineClient:
        """An asyncio engine-API client on the sidecar's Unix socket."""
        return AsyncEngineClient(self.socket, timeout_s=timeout_s)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (clean shutdown), SIGKILL after ``timeout_s``; the exit status."""
        return self.child.stop(timeout_s)

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        self.child.kill()


def serve_argv(socket_path: str, *extra: str, port: int = 0) -> list[str]:
    """The command line of one sidecar (the way an operator runs it)."""
    return [sys.executable, "-m", "kvxferd", "serve", "--engine-socket", socket_path,
            "--peer-port", str(port), *extra]  # fmt: skip


def launch_sidecar(
    name: str,
    socket_path: str,
    *extra: str,
    token: str,
    port: int = 0,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
    die_with_parent: bool = False,
) -> Child:
    """Start one sidecar without waiting; ``token`` is its KVXFERD_PEER_TOKEN."""
    child_env = {**(os.environ if env is None else env), "KVXFERD_PEER_TOKEN": token,
                 "PYTHONUNBUFFERED": "1"}  # fmt: skip
    child_env.setdefault("UCX_NET_DEVICES", "lo")
    return Child.spawn(
        name,
        serve_argv(socket_path, *extra, port=port),
        env=child_env,
        merge_stderr=merge_stderr,
        die_with_parent=die_with_parent,
    )


def wait_ready(child: Child, socket_path: str, timeout_s: float) -> SidecarProcess:
    """Parse the child's ready line (StartupError if it does not come in ``timeout_s``)."""
    line = child.wait_line(READY_PREFIX, timeout_s)
    fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
    try:
        return SidecarProcess(
            socket=fields.get("engine_socket", socket_path),
            peer=fields["peer"],
            engine_id=fields["engine_id"],
            epoch=int(fields["epoch"]),
            child=child,
        )
    except (KeyError, ValueError) as exc:
        child.kill()
        raise StartupError(f"{child.name}: unreadable ready line {line!r}") from exc


def start_sidecars(
    tmp_dir: str,
    names: Sequence[str],
    *extra: str,
    token: str,
    per_rank_args: Sequence[Sequence[str]] | None = None,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
    die_with_parent: bool = False,
    timeout_s: float = READY_TIMEOUT_S,
) -> list[SidecarProcess]:
    """Start one sidecar per name (socket ``tmp_dir/NAME.sock``) and wait for all of them.

    On any failure every sidecar already started is killed and StartupError is raised.
    """
    children: list[tuple[Child, str]] = []
    try:
        for i, name in enumerate(names):
            sock = os.path.join(tmp_dir, f"{name}.sock")
            own = list(per_rank_args[i]) if per_rank_args is not None else []
            child = launch_sidecar(
                name,
                sock,
                *extra,
                *own,
                token=token,
                env=env,
                merge_stderr=merge_stderr,
                die_with_parent=die_with_parent,
            )
            children.append((child, sock))
        deadline = time.monotonic() + timeout_s
        return [
            wait_ready(child, sock, max(0.0, deadline - time.monotonic()))
            for child, sock in children
        ]
    except BaseException:
        for child, _ in children:
            child.kill()
        raise
