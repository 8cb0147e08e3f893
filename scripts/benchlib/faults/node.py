"""One ``kvxferd serve`` whose engine pool this process owns: start, kill -9, stop/continue,
restart on the same peer port (re-registering the same pool), and probes of both its APIs.
"""

from __future__ import annotations

import os
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvxferd.client import EngineClient
from kvxferd.sim.kvpool import RankPool
from kvxferd.sim.sidecars import SidecarProcess, launch_sidecar, wait_ready

from . import osproc

READY_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 5.0


class Node:
    """A restartable sidecar over a fixed pool; ``generation`` counts its (re)starts."""

    def __init__(self, name: str, tmp: str, pool: RankPool, flags: list[str], env: dict[str, str],
                 secret: str) -> None:  # fmt: skip
        self.name = name
        self.socket = os.path.join(tmp, f"{name}.sock")
        self.pool = pool
        self.flags = flags
        self.env = env
        self.secret = secret
        self.port = 0
        self.generation = 0
        self.proc: SidecarProcess | None = None
        self.engine_id = ""

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start (on the remembered port after the first start) and register the pool."""
        child = launch_sidecar(self.name, self.socket, *self.flags, token=self.secret,
                               port=self.port, env=self.env, merge_stderr=True,
                               die_with_parent=True)  # fmt: skip
        self.proc = wait_ready(child, self.socket, READY_TIMEOUT_S)
        self.port = int(self.proc.peer.rsplit(":", 1)[1])
        with EngineClient(self.socket, timeout_s=60.0) as c:
            c.register(self.pool.manifest, self.pool.specs())
        self.engine_id = self.proc.engine_id
        self.generation += 1

    @property
    def peer(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def peer_frames(self) -> str:
        """HOST:PORT of its framed peer API (a new port at every start; "" when off)."""
        return self.proc.peer_frames if self.proc is not None else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.child.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.child.alive()

    def kill(self) -> None:
        """SIGKILL (a crash); waits until it is gone."""
        if self.proc is not None:
            osproc.cont([self.pid])  # a stopped process dies on SIGKILL too, but be explicit
            self.proc.kill()

    def restart(self) -> None:
        """Kill if running, then start again on the same port (bounded retries: the port may
        linger a moment after a kill)."""
        self.kill()
        last: Exception | None = None
        for _ in range(5):
            try:
                self.start()
                return
            except Exception as exc:  # noqa: BLE001 - retried, then re-raised
                last = exc
                time.sleep(0.5)
        assert last is not None
        raise last

    def stop(self) -> int:
        """SIGTERM and wait (bounded): the clean shutdown."""
        if self.proc is None:
            return 0
        osproc.cont([self.pid])
        return self.proc.stop(20.0)

    def output(self) -> str:
        return self.proc.child.output() if self.proc is not None else ""

    # -------------------------------------------------------------- probes

    def client(self, timeout_s: float = 30.0) -> EngineClient:
        return EngineClient(self.socket, timeout_s=timeout_s)

    def problem(self) -> str:
        """Why either API does not answer /healthz now ("" when both do)."""
        if not self.alive():
            return f"{self.name} exited ({self.proc.child.proc.returncode if self.proc else '-'})"
        try:
            with self.client(PROBE_TIMEOUT_S) as c:
                c.healthz()
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            return f"{self.name} engine API: {exc}"[:300]
        try:
            httpx.get(f"http://{self.peer}/healthz", timeout=PROBE_TIMEOUT_S).raise_for_status()
        except Exception as exc:  # noqa: BLE001
            return f"{self.name} peer API: {exc!r}"[:300]
        return ""

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics (labelled ones keyed ``name{k=v,...}``)."""
        text = httpx.get(f"http://{self.peer}/metrics", timeout=PROBE_TIMEOUT_S).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def live_handles(self) -> float | None:
        """``kvxferd_nixl_handles`` now (None when /metrics does not answer)."""
        try:
            return self.metrics().get("kvxferd_nixl_handles", 0.0)
        except Exception:  # noqa: BLE001
            return None

    def usage(self) -> osproc.Usage | None:
        return osproc.usage(self.pid) if self.alive() else None
