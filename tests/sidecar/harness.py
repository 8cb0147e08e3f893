"""Test harness: real ``kvxferd serve`` processes and engine-side KV pools in shared memory.

A ``Sidecar`` is a child process started exactly as an operator would (``python -m kvxferd
serve``); readiness is its stdout line, waited for with a deadline. An ``EnginePool`` is what an
engine rank owns: one shared-memory segment per manifest region, registered through the client.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvxferd.client import EngineClient
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.memory import SharedMemoryRegion
from kvxferd.wire import Manifest, RegionSpec

TOKEN = "test-peer-secret"
READY_TIMEOUT_S = 60.0
SENTINEL = 0xA5


@dataclass
class Sidecar:
    """A running ``kvxferd serve`` child process."""

    socket: str
    peer: str
    engine_id: str
    epoch: int
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(repr=False)
    pump: threading.Thread | None = field(default=None, repr=False)

    def client(self) -> EngineClient:
        return EngineClient(self.socket, timeout_s=30.0)

    def kill(self) -> None:
        """SIGKILL (a crash); waits for the process to be gone."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None and self.pump is not None:
            self.pump.join(timeout=10)
            self.proc.stdout.close()

    def output(self) -> str:
        """Everything the process printed so far."""
        out = []
        while not self.lines.empty():
            out.append(self.lines.get_nowait())
        return "".join(out)

    def stop(self) -> int:
        """SIGTERM (a clean shutdown); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._close_pipe()
        return self.proc.returncode


def start_sidecar(tmp_dir: str, name: str, *extra: str, port: int = 0) -> Sidecar:
    """Start ``kvxferd serve`` and wait (bounded) for its ready line."""
    sock = os.path.join(tmp_dir, f"{name}.sock")
    env = {**os.environ, "KVXFERD_PEER_TOKEN": TOKEN, "UCX_NET_DEVICES": "lo",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxferd", "serve", "--engine-socket", sock,
         "--peer-port", str(port), "--log-level", "warning", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=_pump, args=(proc, lines), daemon=True)
    pump.start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith("kvxferd ready"):
            fields = dict(kv.split("=", 1) for kv in line.split()[2:])
            return Sidecar(sock, fields["peer"], fields["engine_id"], int(fields["epoch"]),
                           proc, lines, pump)  # fmt: skip
        if proc.poll() is not None and lines.empty():
            break
    proc.kill()
    proc.wait(timeout=30)
    pump.join(timeout=10)
    assert proc.stdout is not None
    proc.stdout.close()
    raise RuntimeError(f"sidecar {name} did not become ready:\n" + "".join(seen))


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)


def plan(config: str, *, tp_size: int = 1, tp_rank: int = 0, num_blocks: int = 16,
         **options: object) -> Manifest:  # fmt: skip
    """A planned manifest with region names unique to this test run."""
    engine = f"t{uuid.uuid4().hex[:8]}"
    opts = PlanOptions(tp_size=tp_size, tp_rank=tp_rank, num_blocks=num_blocks,
                       engine_id=engine, **options)  # type: ignore[arg-type]  # fmt: skip
    return plan_manifest(load_hf_config(config), opts)


class EnginePool:
    """An engine rank's KV pool: one shm segment per region, filled with SENTINEL."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.segments = [SharedMemoryRegion.create(r.name, r.size_bytes) for r in manifest.regions]
        self.views = [s.host_view() for s in self.segments]
        for v in self.views:
            v[:] = SENTINEL

    def specs(self) -> list[RegionSpec]:
        return [RegionSpec(name=r.name, size_bytes=r.size_bytes) for r in self.manifest.regions]

    def snapshot(self) -> list[np.ndarray]:
        return [v.copy() for v in self.views]

    def close(self) -> None:
        for s in self.segments:
            s.close()


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):  # noqa: ANN001
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def encode(value: object) -> bytes:
    return msgspec.json.encode(value)
