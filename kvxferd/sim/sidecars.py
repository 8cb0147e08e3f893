"""The sidecars of a simulated engine's ranks: started here, or attached to.

Started: ``kvxferd serve`` children, one per rank, all at once, sharing one deadline for their
ready lines (``kvxferd ready engine_socket=PATH peer=HOST:PORT engine_id=ID epoch=N``), each a
:class:`SidecarProcess`. Attached: sidecars someone else runs (their own container in a pod),
reached through their engine sockets once each answers ``/healthz`` (bounded wait), each an
:class:`AttachedSidecar`. The sim treats both alike (:class:`RankSidecar`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvxferd.client import AsyncEngineClient, EngineClient, SidecarError, frames_available
from kvxferd.errors import AlreadyRegisteredError, StartupError
from kvxferd.sim.children import Child
from kvxferd.sim.kvpool import RankPool

READY_PREFIX = "kvxferd ready"
READY_TIMEOUT_S = 60.0
_PROBE_EVERY_S = 0.2


class RankSidecar(Protocol):
    """What the sim needs of one rank's sidecar, started or attached."""

    socket: str
    peer: str
    engine_id: str

    def client(self, timeout_s: float = 30.0) -> EngineClient: ...

    def async_client(self, timeout_s: float = 30.0) -> AsyncEngineClient: ...

    def problem(self) -> str: ...


@dataclass
class SidecarProcess:
    """A running ``kvxferd serve`` child and what its ready line said."""

    socket: str
    peer: str
    engine_id: str
    epoch: int
    child: Child
    peer_frames: str = ""
    """HOST:PORT of its framed peer API ("" when it serves none)."""

    def client(self, timeout_s: float = 30.0) -> EngineClient:
        """A blocking engine-API client on the sidecar's Unix socket."""
        return EngineClient(self.socket, timeout_s=timeout_s)

    def async_client(self, timeout_s: float = 30.0) -> AsyncEngineClient:
        """An asyncio engine-API client on the sidecar's Unix socket: its framed protocol when
        the sidecar serves it, else HTTP with MessagePack bodies."""
        return _async_client(self.socket, timeout_s)

    def problem(self) -> str:
        """Why this sidecar cannot serve ("" while its process runs)."""
        return "" if self.child.alive() else f"sidecar {self.engine_id} exited"

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
            peer_frames=fields.get("peer_frames", ""),
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
    port: int = 0,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
    die_with_parent: bool = False,
    timeout_s: float = READY_TIMEOUT_S,
) -> list[SidecarProcess]:
    """Start one sidecar per name (socket ``tmp_dir/NAME.sock``) and wait for all of them.

    ``port`` is every sidecar's peer port (0: each picks a free one).

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
                port=port,
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


@dataclass
class AttachedSidecar:
    """A ``kvxferd serve`` this process did not start, reached through its engine socket;
    ``peer``, ``engine_id`` and ``epoch`` come from its answer to our registration."""

    socket: str
    peer: str = ""
    engine_id: str = ""
    epoch: int = 0
    identity: tuple[int, int, int] = (0, 0, 0)
    """(device, inode, ctime) of the socket file when we registered: a restarted sidecar binds
    a new file."""

    def client(self, timeout_s: float = 30.0) -> EngineClient:
        """A blocking engine-API client on the sidecar's Unix socket."""
        return EngineClient(self.socket, timeout_s=timeout_s)

    def async_client(self, timeout_s: float = 30.0) -> AsyncEngineClient:
        """An asyncio engine-API client on the sidecar's Unix socket: its framed protocol when
        the sidecar serves it, else HTTP with MessagePack bodies."""
        return _async_client(self.socket, timeout_s)

    def problem(self) -> str:
        """Why this sidecar cannot serve: its socket is gone (it exited), or is another one (it
        restarted and forgot our registration: restart this engine). "" otherwise."""
        try:
            now = _identity(self.socket)
        except FileNotFoundError:
            return f"sidecar socket {self.socket} is gone"
        if any(self.identity) and now != self.identity:
            return f"sidecar at {self.socket} restarted; this engine must register again"
        return ""


def _async_client(socket_path: str, timeout_s: float) -> AsyncEngineClient:
    frames = frames_available(socket_path)
    return AsyncEngineClient(socket_path, timeout_s=timeout_s, msgpack=True, frames=frames)


def _identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_ctime_ns


def attach_sidecars(sockets: Sequence[str], timeout_s: float) -> list[AttachedSidecar]:
    """Wait until every socket's sidecar answers ``/healthz`` (one shared deadline; the sidecar
    container may still be starting); StartupError naming the first that does not."""
    deadline = time.monotonic() + timeout_s
    for path in sockets:
        with EngineClient(path, timeout_s=max(1.0, _PROBE_EVERY_S * 5)) as client:
            while True:
                try:
                    client.healthz()
                    break
                except SidecarError as exc:
                    if time.monotonic() >= deadline:
                        raise StartupError(
                            f"--sidecar-socket {path}: no sidecar answered /healthz within "
                            f"{timeout_s:g}s (last: {exc})"
                        ) from exc
                time.sleep(_PROBE_EVERY_S)  # a poll interval, not synchronisation
    return [AttachedSidecar(path) for path in sockets]


def register_pools(
    sidecars: Sequence[RankSidecar], pools: Sequence[RankPool], timeout_s: float
) -> None:
    """Register each rank's pool with its sidecar; an attached sidecar learns its identity."""
    for s, pool in zip(sidecars, pools, strict=True):
        with s.client(timeout_s=timeout_s) as c:
            try:
                answer = c.register(pool.manifest, pool.specs())
            except AlreadyRegisteredError as exc:
                raise StartupError(
                    f"sidecar at {s.socket} already has an engine (an earlier run of this sim?); "
                    "restart the sidecar, then this engine"
                ) from exc
        if isinstance(s, AttachedSidecar):
            s.peer, s.engine_id, s.epoch = answer.peer_address, answer.engine_id, answer.epoch
            s.identity = _identity(s.socket)
