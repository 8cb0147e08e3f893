"""Transport tests move bytes over UCX between real processes, pinned to loopback.

``peer`` is a target sidecar in a spawned process reading from an engine-owned shared-memory
segment ``src`` (random bytes, created here); ``agent`` is the initiator in this process with
a destination segment ``dst`` full of a sentinel byte.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvxferd.memory import SharedMemoryRegion  # noqa: E402
from kvxferd.transport import Agent  # noqa: E402
from tests.transport import peer as peer_main  # noqa: E402

SRC_BYTES = 4 << 20
DST_BYTES = 4 << 20
SENTINEL = 0xA5
START_TIMEOUT_S = 60.0


def unique(prefix: str) -> str:
    """A name no other test (or test run) uses."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class Peer:
    """Handle on the target process."""

    name: str
    src: SharedMemoryRegion
    process: mp.process.BaseProcess
    conn: object
    metadata: bytes = b""
    remote_base: int = 0
    received: dict[str, list[bytes]] = field(default_factory=dict)

    def notifs(self) -> dict[str, list[bytes]]:
        """Everything the target has received so far."""
        self.conn.send(("notifs",))
        return self.conn.recv()

    def wait_notifs(self, sender: str, count: int, timeout_s: float = 10.0) -> list[bytes]:
        """Poll the target until ``sender`` has sent ``count`` messages (or the deadline)."""
        deadline = time.monotonic() + timeout_s
        got: list[bytes] = []
        while time.monotonic() < deadline:
            got = self.notifs().get(sender, [])
            if len(got) >= count:
                break
        return got

    def pause(self, seconds: float) -> None:
        """Make the target stop polling NIXL for ``seconds``."""
        self.conn.send(("pause", seconds))
        assert self.conn.recv() == "paused"

    def kill(self) -> None:
        """SIGKILL the target and reap it."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(30)

    def stop(self) -> None:
        """Ask the target to exit; kill it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop",))
            self.process.join(30)
            if self.process.is_alive():
                self.kill()


def read_tables(peer: Peer, dst: SharedMemoryRegion, ranges: list[tuple[int, int, int]]
                ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """READ tables for ``(src offset, dst offset, length)`` ranges: (local, remote) N x 2."""
    local = np.array([[dst.base_addr + d, n] for _, d, n in ranges], dtype=np.uint64)
    remote = np.array([[peer.remote_base + s, n] for s, _, n in ranges], dtype=np.uint64)
    return local, remote


def assert_landed(peer: Peer, dst: SharedMemoryRegion, ranges: list[tuple[int, int, int]]
                  ) -> None:  # fmt: skip
    """Every byte of each range arrived from ``src``; every other byte of ``dst`` is SENTINEL."""
    src, out = peer.src.host_view(), dst.host_view()
    expected = np.full_like(out, SENTINEL)
    for s, d, n in ranges:
        expected[d : d + n] = src[s : s + n]
    mismatch = np.flatnonzero(out != expected)
    assert mismatch.size == 0, f"{mismatch.size} bytes differ, first at dst offset {mismatch[0]}"


def start_peer(progress: bool = True) -> Peer:
    """Create ``src`` (random bytes) and start a target process serving it."""
    src = SharedMemoryRegion.create(unique("kvx-src"), SRC_BYTES)
    src.host_view()[:] = np.random.default_rng(7).integers(0, 256, SRC_BYTES, dtype=np.uint8)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    name = unique("target")
    proc = ctx.Process(
        target=peer_main.serve, args=(theirs, name, src.name, SRC_BYTES, progress), daemon=True
    )
    proc.start()
    theirs.close()
    peer = Peer(name, src, proc, ours)
    if not ours.poll(START_TIMEOUT_S):
        peer.kill()
        src.close()
        raise RuntimeError("target process did not start")
    _, peer.metadata, peer.remote_base = ours.recv()
    return peer


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = start_peer(progress=True)
    yield p
    p.stop()
    p.src.close()


@pytest.fixture
def own_peer() -> Iterator[Peer]:
    """A target just for this test (it may be paused or killed)."""
    p = start_peer(progress=False)
    yield p
    p.stop()
    p.src.close()


@pytest.fixture
def dst() -> Iterator[SharedMemoryRegion]:
    region = SharedMemoryRegion.create(unique("kvx-dst"), DST_BYTES)
    region.host_view()[:] = SENTINEL
    yield region
    region.close()


@pytest.fixture
def agent(dst: SharedMemoryRegion) -> Iterator[Agent]:
    a = Agent(unique("initiator"))
    a.register(dst)
    yield a
    a.close()
