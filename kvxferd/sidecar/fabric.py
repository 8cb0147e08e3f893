"""Fabric readiness: a self-test READ at registration, and the UCX transports READs really use.

After an engine registers, a loopback agent in this process READs a few bytes of the first
DRAM region through NIXL (the whole path: registration, metadata, UCX endpoint, completion).
UCX's protocol log (:mod:`kvxferd.transport.fabric`) then says which transports it chose, for
the self-test and for every peer connection since. With ``--require-transport rdma`` the
sidecar is not ready (/readyz 503, naming why) when the host has no RDMA device or a READ went
over TCP, instead of falling back to TCP in silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvxferd.errors import (
    FabricNotReadyError,
    KvxferdError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvxferd.memory import SharedMemoryRegion
from kvxferd.transport import Agent, Transfer, TransferState
from kvxferd.transport.fabric import ProtoLog, kind

log = logging.getLogger(__name__)

SELF_TEST_BYTES = 64
"""Bytes the self-test READ moves."""
SELF_TEST_S = 10.0
"""Bound on the self-test READ."""


TCP_RECHECK_S = 5.0
"""How often :meth:`Fabric.reads_over_tcp` rescans the UCX protocol log."""


def _post_probe(stack: contextlib.ExitStack, agent: Agent, region: Any) -> Transfer:
    """A probe agent posting the self-test READ of ``region`` (its resources on ``stack``)."""
    name = f"{agent.name}-selftest-{uuid.uuid4().hex[:6]}"
    probe = stack.enter_context(Agent(name, backends=("UCX",), progress_thread=False))
    dst = stack.enter_context(SharedMemoryRegion.create(f"kvx-{uuid.uuid4().hex[:12]}", 4096))
    probe.register(dst)
    remote = probe.add_remote(agent.get_agent_metadata())
    local = np.array([[dst.base_addr, SELF_TEST_BYTES]], dtype=np.uint64)
    src = np.array([[region.base_addr, SELF_TEST_BYTES]], dtype=np.uint64)
    return stack.enter_context(probe.read(remote, local, src))


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices the kernel exposes (InfiniBand, RoCE, EFA: all appear under verbs)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


class Fabric:
    """What this sidecar's data plane has shown it can do, for /readyz and the metrics."""

    def __init__(
        self,
        require: str,
        proto_log: str,
        *,
        devices: Callable[[], list[str]] = rdma_devices,
        metric: Any = None,
    ) -> None:
        self.require = require
        """``rdma`` or ``any`` (``--require-transport``)."""
        self._log = ProtoLog(proto_log) if proto_log and proto_log != "off" else None
        self._devices = devices
        self._metric = metric
        self._tcp, self._tcp_checked = False, float("-inf")
        self.self_test = ""
        """``ok`` once the self-test READ completed, the error if it failed, "" before."""

    async def run_self_test(
        self, agent: Agent, regions: Sequence[Any], progress: Callable[[], object]
    ) -> None:
        """READ a few bytes of the first DRAM region from a loopback agent. ``progress`` drives
        this sidecar's UCX worker while the READ is out (without a progress thread the READ's
        wireup waits on it; the notification poller may not be running yet). Records the
        outcome in :attr:`self_test`; never raises."""
        region = next((r for r in regions if r.mem == "DRAM" and r.size >= SELF_TEST_BYTES), None)
        if region is None:
            self.self_test = "skipped: no DRAM region"
            return
        with contextlib.ExitStack() as stack:
            try:
                # Agent creation and registration block for milliseconds: off the event loop.
                xfer = await asyncio.to_thread(_post_probe, stack, agent, region)
                deadline = time.monotonic() + SELF_TEST_S
                pause = 1e-4
                while (state := xfer.poll()) is TransferState.POSTED:
                    if time.monotonic() >= deadline:
                        raise TransferTimeoutError(f"not done after {SELF_TEST_S:g} s")
                    progress()
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 0.01)
                if state is TransferState.FAILED:
                    raise xfer.error or TransferFailedError("failed")
                self.self_test = "ok"
            except KvxferdError as exc:
                self.self_test = f"failed: {exc}"
                log.error("self-test READ failed: %s", exc)
            finally:
                await asyncio.to_thread(stack.close)

    def transports(self) -> dict[str, dict[str, list[str]]]:
        """UCX transports seen so far: ``reads`` and ``messages``, by endpoint kind."""
        if self._log is None:
            return {}
        lanes = self._log.scan()
        out = {
            "reads": {ep: sorted(ts) for ep, ts in lanes.reads.items()},
            "messages": {ep: sorted(ts) for ep, ts in lanes.messages.items()},
        }
        if self._metric is not None:
            for lane, table in out.items():
                for ep, ts in table.items():
                    for t in ts:
                        self._metric.labels(lane, ep, kind(t)).set(1)
        return out

    def reads_over_tcp(self, now: float) -> bool:
        """Whether a READ between agents went over TCP (rechecked at most every
        TCP_RECHECK_S). Over TCP the target's UCX worker must progress for a READ to move, so
        a sidecar without a progress thread polls fast while a hold is claimed."""
        if now - self._tcp_checked >= TCP_RECHECK_S:
            self._tcp_checked = now
            try:
                reads = self.transports().get("reads", {})
            except OSError as exc:  # the log unreadable: keep what we knew (pulls go on)
                log.warning("reading the UCX protocol log failed: %s", exc)
                return self._tcp
            self._tcp = any(kind(t) == "tcp" for ep, ts in reads.items() if ep != "self"
                            for t in ts)  # fmt: skip
        return self._tcp

    def problem(self, transports: dict[str, dict[str, list[str]]]) -> str:
        """Why the data plane is not ready ("" when it is)."""
        if self.self_test.startswith("failed"):
            return f"self-test READ {self.self_test}"
        if self.require != "rdma":
            return ""
        if not self._devices():
            return "require-transport rdma: this host has no RDMA device (no verbs device)"
        tcp = sorted(
            f"{ep}: {t}"
            for ep, ts in transports.get("reads", {}).items()
            if ep != "self"
            for t in ts
            if kind(t) == "tcp"
        )
        if tcp:
            return f"require-transport rdma: READs went over TCP ({', '.join(tcp)})"
        return ""

    def readiness(self) -> dict[str, Any]:
        """The /readyz body; FabricNotReadyError (503) naming why when not ready."""
        transports = self.transports()
        why = self.problem(transports)
        if why:
            raise FabricNotReadyError(why)
        return {
            "ready": True,
            "require_transport": self.require,
            "self_test": self.self_test,
            "transports": transports,
        }

    def close(self) -> None:
        """Remove the protocol log file this process wrote (best effort: a path that cannot be
        removed, e.g. a directory put there, is logged and left, so shutdown goes on)."""
        if self._log is not None:
            try:
                Path(self._log.path).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove the UCX protocol log %s: %s", self._log.path, exc)
