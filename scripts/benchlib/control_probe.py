"""Looking inside a running sim for the control-plane benchmark: its sidecars' peer addresses,
their pull-phase histograms, and the sim's ``/v1/stats`` counters.

A sim prints only its own URL; its sidecars' peer ports are found from ``/proc`` (the sim's
child processes, their listening TCP sockets), then confirmed by asking each for ``/metrics``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

PHASE_METRIC = "kvxferd_pull_phase_duration_seconds"
_LISTEN = "0A"


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc/PID/task/*/children``)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                out.extend(int(x) for x in fh.read().split())
        except OSError:
            continue
    return sorted(set(out))


def listening_ports(pid: int) -> list[int]:
    """TCP ports ``pid`` listens on: its socket inodes matched against /proc/PID/net/tcp{,6}."""
    inodes: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _LISTEN and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@dataclass(frozen=True)
class SidecarAddress:
    """Where a sim's sidecar listens: its peer API (HOST:PORT) and its engine socket."""

    peer: str
    engine_socket: str | None


def sidecars(
    sim_pid: int, host: str = "127.0.0.1", timeout_s: float = 10.0
) -> list[SidecarAddress]:
    """Every ``kvxferd serve`` child of the sim whose TCP port answers kvxferd ``/metrics``;
    empty when /proc is unreadable (not Linux, another user)."""
    found = []
    for pid in child_pids(sim_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0")]
        except OSError:
            continue
        if "serve" not in argv:
            continue
        sock = argv[argv.index("--engine-socket") + 1] if "--engine-socket" in argv[:-1] else None
        for port in listening_ports(pid):
            addr = f"{host}:{port}"
            if phase_sums(addr, timeout_s) is not None:
                found.append(SidecarAddress(addr, sock))
                break
    return found


def phase_sums(peer: str, timeout_s: float = 10.0) -> dict[str, tuple[float, int]] | None:
    """``{phase: (seconds, count)}`` of the sidecar's pull-phase histogram, or None when
    ``peer`` does not serve kvxferd metrics."""
    try:
        resp = httpx.get(f"http://{peer}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200 or PHASE_METRIC not in resp.text:
        return None
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(resp.text):
        if family.name != PHASE_METRIC:
            continue
        for s in family.samples:
            slot = out.setdefault(s.labels.get("phase", ""), [0.0, 0])
            if s.name.endswith("_sum"):
                slot[0] = s.value
            elif s.name.endswith("_count"):
                slot[1] = int(s.value)
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def phase_means_ms(
    before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]
) -> dict[str, float]:
    """Mean milliseconds per observation of each phase between two :func:`phase_sums`."""
    out = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, (0.0, 0))
        if count > c0:
            out[phase] = (total - t0) / (count - c0) * 1e3
    return out


def stats(url: str, timeout_s: float = 10.0) -> dict:
    """The sim's ``/v1/stats`` object."""
    resp = httpx.get(url + "/v1/stats", timeout=timeout_s)
    resp.raise_for_status()
    return dict(resp.json())


def delta(before: dict, after: dict, keys: Iterable[str]) -> dict:
    """``after - before`` of the numeric ``keys`` of two stats objects."""
    return {k: after[k] - before[k] for k in keys}


def _machine_jiffies() -> tuple[int, int]:
    """(busy, steal) CPU time of the whole machine (``/proc/stat``), in clock ticks. Steal is
    time the hypervisor gave our virtual CPUs to someone else: CPU we wanted and did not get."""
    with open("/proc/stat") as fh:
        cols = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (cols + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _proc_jiffies(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(rest[11]) + int(rest[12])


class CpuMeter:
    """CPU the benchmark's own processes used (each, and together) vs everything else on the
    machine over an interval: shows which process saturates, and whether a number was taken
    while something else was running."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = {role: sorted(set(pids)) for role, pids in roles.items()}
        self.hz = os.sysconf("SC_CLK_TCK")
        self._start = self._sample()

    def _sample(self) -> tuple[float, tuple[int, int], dict[str, int]]:
        per_role = {r: sum(_proc_jiffies(p) for p in pids) for r, pids in self.roles.items()}
        return time.monotonic(), _machine_jiffies(), per_role

    def restart(self) -> None:
        """Start a new interval now."""
        self._start = self._sample()

    def read(self) -> dict:
        """Cores (averages over the interval): ``ours`` busy, ``others`` busy (other processes
        of this machine), ``steal`` (taken by the hypervisor), ``total`` busy,
        ``by_process`` (ours per role) and ``cpu_s`` (CPU seconds per role, unrounded)."""
        t1, (busy1, steal1), roles1 = self._sample()
        t0, (busy0, steal0), roles0 = self._start
        wall = max(t1 - t0, 1e-9)
        by = {r: round((roles1[r] - roles0[r]) / self.hz / wall, 2) for r in roles1}
        total = (busy1 - busy0) / self.hz / wall
        ours = sum(roles1[r] - roles0[r] for r in roles1) / self.hz / wall
        cpu_s = {r: (roles1[r] - roles0[r]) / self.hz for r in roles1}
        return {"ours": round(ours, 2), "others": round(max(total - ours, 0.0), 2),
                "steal": round((steal1 - steal0) / self.hz / wall, 2), "total": round(total, 2),
                "by_process": by, "cpu_s": cpu_s}  # fmt: skip
