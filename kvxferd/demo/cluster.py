"""The demo's processes on loopback: prefill and decode sims, a colocated reference sim and the
proxy, each a ``python -m kvxferd`` child found through its ready line (bounded wait).

All sims share one random peer token; ``UCX_NET_DEVICES`` defaults to ``lo``. Stopping sends
SIGTERM to every child at once, waits (bounded), then kills; sims unlink their shared memory
early and their sidecars die with them, so nothing is left behind.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

import httpx

from kvxferd.sim.children import Child

log = logging.getLogger(__name__)

SIM_READY = "kvxferd sim ready "
PROXY_READY = "kvxferd proxy ready "


@dataclass(frozen=True)
class ClusterSpec:
    """What to start."""

    config: str
    prefill_tp: int = 1
    decode_tp: int = 1
    pool_blocks: int | None = None
    prefills: int = 1
    decodes: int = 1
    colocated: bool = True
    """Also start a colocated sim (decode's TP) whose answers are the reference texts."""
    on_pull_failure: str = "fail"
    """``fail`` so a broken transfer shows up as an error, never as a silent recompute."""
    proxy_timeout_s: float = 60.0
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0
    log_level: str = "warning"
    store_dir: str = ""
    """Prefill sims use the store in this directory as a prefix-cache tier ("" = none)."""


@dataclass
class Sim:
    """One running ``kvxferd sim``: its role, argv (to restart it on the same port) and URL."""

    role: str
    argv: list[str]
    child: Child
    url: str
    model: str

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


class Cluster:
    """Start with :meth:`start` (or ``with``); every child is stopped by :meth:`stop`."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.env = {
            **os.environ,
            "KVXFERD_PEER_TOKEN": secrets.token_hex(16),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            "PYTHONUNBUFFERED": "1",
        }
        self.prefills: list[Sim] = []
        self.decodes: list[Sim] = []
        self.colocated: Sim | None = None
        self.proxy: Child | None = None
        self.proxy_url = ""
        self._children: list[Child] = []

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def model(self) -> str:
        return self.decodes[0].model

    def start(self) -> None:
        """Start every sim at once, wait for their ready lines, then start the proxy."""
        s = self.spec
        plan = [("prefill", s.prefill_tp)] * s.prefills + [("decode", s.decode_tp)] * s.decodes
        if s.colocated:
            plan.append(("colocated", s.decode_tp))
        argvs = [self._sim_argv(role, tp, port=0) for role, tp in plan]
        names = [f"{role} sim {i}" for i, (role, _) in enumerate(plan)]
        children = [self._spawn(name, argv) for name, argv in zip(names, argvs, strict=True)]
        for (role, _), argv, child in zip(plan, argvs, children, strict=True):
            sim = self._ready_sim(role, argv, child)
            if role == "prefill":
                self.prefills.append(sim)
            elif role == "decode":
                self.decodes.append(sim)
            else:
                self.colocated = sim
        argv = [sys.executable, "-m", "kvxferd", "proxy",
                "--prefill", *[p.url for p in self.prefills],
                "--decode", *[d.url for d in self.decodes],
                "--port", "0", "--timeout", f"{s.proxy_timeout_s:g}",
                "--log-level", s.log_level]  # fmt: skip
        self.proxy = self._spawn("proxy", argv)
        line = self.proxy.wait_line(PROXY_READY, s.ready_timeout_s)
        self.proxy_url = line.split("url=", 1)[1].split()[0]

    def _sim_argv(self, role: str, tp: int, port: int) -> list[str]:
        s = self.spec
        argv = [sys.executable, "-m", "kvxferd", "sim", "--role", role, "--config", s.config,
                "--tp", str(tp), "--host", "127.0.0.1", "--port", str(port),
                "--log-level", s.log_level]  # fmt: skip
        if s.pool_blocks is not None:
            argv += ["--pool-blocks", str(s.pool_blocks)]
        if role == "decode":
            argv += ["--on-pull-failure", s.on_pull_failure]
        if role == "prefill" and s.store_dir:
            argv += ["--store", s.store_dir]
        return argv

    def _spawn(self, name: str, argv: list[str]) -> Child:
        child = Child.spawn(name, argv, env=self.env, merge_stderr=True, die_with_parent=True)
        self._children.append(child)
        return child

    def _ready_sim(self, role: str, argv: list[str], child: Child) -> Sim:
        line = child.wait_line(SIM_READY, self.spec.ready_timeout_s)
        fields = dict(kv.split("=", 1) for kv in line[len(SIM_READY) :].split() if "=" in kv)
        return Sim(role, argv, child, fields["url"], fields.get("model", ""))

    def kill_prefill(self, index: int) -> None:
        """SIGKILL one prefill sim (a crash); its port stays free for :meth:`restart_prefill`."""
        child = self.prefills[index].child
        child.kill()
        self._children.remove(child)

    def restart_prefill(self, index: int) -> None:
        """Start the prefill again on the same port (new sidecars, new engine ids)."""
        old = self.prefills[index]
        argv = self._sim_argv("prefill", self.spec.prefill_tp, port=old.port)
        child = self._spawn(f"prefill sim {index} (restarted)", argv)
        self.prefills[index] = self._ready_sim("prefill", argv, child)

    def stats(self, sim: Sim, timeout_s: float = 30.0) -> dict[str, Any]:
        """The sim's ``/v1/stats`` (httpx errors propagate)."""
        resp = httpx.get(sim.url + "/v1/stats", timeout=timeout_s)
        resp.raise_for_status()
        return dict(resp.json())

    def stop(self) -> None:
        """Stop every child at once (SIGTERM, bounded wait, SIGKILL); logs non-zero exits."""
        children, self._children = self._children, []
        if not children:
            return
        with concurrent.futures.ThreadPoolExecutor(len(children)) as pool:
            codes = list(pool.map(lambda c: c.stop(self.spec.stop_timeout_s), children))
        for child, code in zip(children, codes, strict=True):
            if code not in (0, None):
                log.warning("%s exited with status %s; its last output:\n%s", child.name, code,
                            child.output()[-4000:])  # fmt: skip
