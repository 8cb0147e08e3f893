"""Sidecar processes and engine pools for the transfer benchmark.

A ``SidecarProcess`` is ``python -m kvxferd serve`` started the way an operator would, ready when
it prints its ready line (bounded wait). A ``Pool`` is an engine rank's KV memory: one POSIX
shared-memory segment per manifest region, which the sidecar maps by name.
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
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.client import EngineClient
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.sim.kvpool import RankPool
from kvxferd.wire import Manifest

TOKEN = "bench-peer-secret"
READY_TIMEOUT_S = 60.0
SENTINEL = 0xA5


@dataclass
class SidecarProcess:
    """A running ``kvxferd serve`` child; ``peer`` is its HOST:PORT peer API address."""

    socket: str
    peer: str
    proc: subprocess.Popen[str]
    lines: queue.Queue[str] = field(repr=False)

    @classmethod
    def start_many(
        cls, tmp_dir: str, names: list[str], wrap: Callable[[str], list[str]] | None = None,
        args: list[str] = (),  # type: ignore[assignment]
    ) -> list[SidecarProcess]:  # fmt: skip
        """Start one sidecar per name (in parallel) on Unix sockets under ``tmp_dir``.

        Waits (bounded) for every ready line; on failure stops those already started.
        ``wrap(name)`` gives what runs instead of ``-m kvxferd`` (e.g. a profiling wrapper
        script and its arguments, which then pass the rest on to kvxferd); ``args`` are more
        ``serve`` flags.
        """
        launched = [_launch(tmp_dir, n, wrap(n) if wrap else ["-m", "kvxferd"], list(args))
                    for n in names]  # fmt: skip
        ready: list[SidecarProcess] = []
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            for name, (sock, proc, lines) in zip(names, launched, strict=True):
                ready.append(_wait_ready(name, sock, proc, lines, deadline))
        except BaseException:
            for _sock, proc, _lines in launched:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
            raise
        return ready

    def client(self, frames: bool = False) -> EngineClient:
        """An engine-API client on the Unix socket (``frames``: over its framed protocol, the
        wire the engines use)."""
        return EngineClient(self.socket, timeout_s=120.0, frames=frames)

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")

    def phase_sums(self) -> dict[str, tuple[float, int]]:
        """``{phase: (seconds, count)}`` of kvxferd_pull_phase_duration_seconds from /metrics."""
        text = httpx.get(f"http://{self.peer}/metrics", timeout=30).text
        out: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name != "kvxferd_pull_phase_duration_seconds":
                continue
            for s in family.samples:
                phase = s.labels.get("phase", "")
                slot = out.setdefault(phase, [0.0, 0])
                if s.name.endswith("_sum"):
                    slot[0] = s.value
                elif s.name.endswith("_count"):
                    slot[1] = int(s.value)
        return {k: (v[0], int(v[1])) for k, v in out.items()}

    def reads_by_path(self) -> dict[str, int]:
        """READs posted so far by path (kvxferd_reads_total: tables, prepped, staged)."""
        text = httpx.get(f"http://{self.peer}/metrics", timeout=30).text
        return {s.labels.get("path", ""): int(s.value)
                for family in text_string_to_metric_families(text)
                if family.name == "kvxferd_reads" for s in family.samples
                if s.name == "kvxferd_reads_total"}  # fmt: skip

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def _launch(
    tmp_dir: str, name: str, runner: list[str], args: list[str]
) -> tuple[str, subprocess.Popen[str], queue.Queue[str]]:
    sock = os.path.join(tmp_dir, f"{name}.sock")
    env = {**os.environ, "KVXFERD_PEER_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    env.setdefault("UCX_NET_DEVICES", "lo")
    cmd = [
        sys.executable,
        *runner,
        "serve",
        "--engine-socket",
        sock,
        "--peer-port",
        "0",
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    return sock, proc, lines


def _wait_ready(
    name: str, sock: str, proc: subprocess.Popen[str], lines: queue.Queue[str], deadline: float
) -> SidecarProcess:
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith("kvxferd ready"):
            fields = dict(kv.split("=", 1) for kv in line.split()[2:])
            return SidecarProcess(sock, fields["peer"], proc, lines)
    raise RuntimeError(f"sidecar {name} did not become ready:\n" + "".join(seen))


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)


def plan(config: str, num_blocks: int, options: dict) -> Manifest:
    """A planned manifest whose region (shm) names are unique to this run."""
    opts = PlanOptions(num_blocks=num_blocks, engine_id=f"b{uuid.uuid4().hex[:8]}", **options)
    return plan_manifest(load_hf_config(config), opts)


class Pool(RankPool):
    """The sim's per-rank shm pool, filled with SENTINEL, with its base addresses at hand."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        for v in self.views:
            v[:] = SENTINEL
        self.bases = np.array([s.base_addr for s in self.segments], dtype=np.int64)
