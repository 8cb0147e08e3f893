"""Soak: verified requests through proxy -> prefill sim -> decode sim for a while, at a given
concurrency, with RSS, fd and thread counts of every process (sims, their sidecars, the proxy)
sampled after a warm-up and at the end, reported as growth per 1,000 requests.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx

from kvxferd.demo import Cluster, ClusterSpec

from . import osproc

WARMUP_REQUESTS = 50
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
    "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi",
]  # fmt: skip


def _processes(cluster: Cluster) -> dict[str, int]:
    out = {}
    for sim in cluster.prefills + cluster.decodes:
        out[f"{sim.role}-sim"] = sim.child.pid
        for i, pid in enumerate(osproc.children_of(sim.child.pid)):
            out[f"{sim.role}-sidecar{i}"] = pid
    assert cluster.proxy is not None
    out["proxy"] = cluster.proxy.pid
    return out


def _sample(pids: dict[str, int]) -> dict[str, osproc.Usage | None]:
    return {name: osproc.usage(pid) for name, pid in pids.items()}


class _Load:
    """Worker threads sending completions through the proxy until told to stop."""

    def __init__(self, url: str, model: str, concurrency: int, seed: int) -> None:
        self.url, self.model = url, model
        self.ok = self.failed = 0
        self.errors: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True)
                         for i in range(concurrency)]  # fmt: skip

    @property
    def done(self) -> int:
        return self.ok + self.failed

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60.0) as http:
            while not self._stop.is_set():
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 400)))
                body = {"model": self.model, "prompt": prompt, "max_tokens": rng.randint(1, 8)}
                try:
                    resp = http.post(self.url + "/v1/completions", json=body)
                    good, why = resp.status_code == 200, str(resp.status_code)
                except httpx.HTTPError as exc:
                    good, why = False, type(exc).__name__
                with self._lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failed += 1
                        self.errors[why] = self.errors.get(why, 0) + 1


def soak(config: str, seconds: float, concurrency: int, seed: int) -> dict[str, Any]:
    """Run the soak; the report (``ok`` false when any request failed or a byte was wrong)."""
    spec = ClusterSpec(config=config, pool_blocks=1024, colocated=False, on_pull_failure="fail",
                       proxy_timeout_s=60.0)  # fmt: skip
    with Cluster(spec) as cluster:
        load = _Load(cluster.proxy_url, cluster.model, concurrency, seed)
        pids = _processes(cluster)
        load.start()
        end_warm = time.monotonic() + 120
        while load.done < WARMUP_REQUESTS and time.monotonic() < end_warm:
            time.sleep(0.2)
        first, n0, t0 = _sample(pids), load.done, time.monotonic()
        while time.monotonic() < t0 + seconds:
            time.sleep(0.5)
        last, n1, t1 = _sample(pids), load.done, time.monotonic()
        load.stop()
        decode = cluster.stats(cluster.decodes[0])
    per_k = max(1, n1 - n0) / 1000.0
    procs = {}
    for name in pids:
        a, b = first.get(name), last.get(name)
        if a is None or b is None:
            procs[name] = {"exited": True}
            continue
        procs[name] = {
            "rss_mib_start": round(a.rss_bytes / 2**20, 1),
            "rss_mib_end": round(b.rss_bytes / 2**20, 1),
            "rss_mib_per_1k": round((b.rss_bytes - a.rss_bytes) / 2**20 / per_k, 3),
            "fds_start": a.fds, "fds_end": b.fds, "fds_per_1k": round((b.fds - a.fds) / per_k, 3),
            "threads_start": a.threads, "threads_end": b.threads,
            "threads_per_1k": round((b.threads - a.threads) / per_k, 3),
        }  # fmt: skip
    return {
        "soak_seconds": round(t1 - t0, 1), "concurrency": concurrency,
        "requests": load.done, "measured_requests": n1 - n0, "ok_requests": load.ok,
        "failed_requests": load.failed, "errors": load.errors,
        "rps": round((n1 - n0) / max(1e-9, t1 - t0), 2),
        "decode_verified_ok": decode.get("verified_ok"),
        "decode_verified_failed": decode.get("verified_failed"),
        "decode_pulls_failed": decode.get("pulls_failed"),
        "processes": procs,
        "ok": load.failed == 0 and decode.get("verified_failed", 1) == 0,
    }  # fmt: skip
