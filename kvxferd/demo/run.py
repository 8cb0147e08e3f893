"""One demo run: start the cluster, get the colocated reference texts, drive the jobs through the
proxy, read the decode sims' counters, stop everything, and summarise.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, replace

import httpx

from kvxferd.demo.cluster import Cluster, ClusterSpec
from kvxferd.demo.drive import Progress, drive
from kvxferd.demo.summary import Summary, summarize
from kvxferd.demo.workload import Job, make_jobs

DEFAULT_CONFIG = "granite-4.0-h-tiny"
"""A bundled hybrid (Mamba2 + attention), so both KV and state bytes move."""


@dataclass(frozen=True)
class DemoOptions:
    """The ``kvxferd demo`` flags."""

    config: str = DEFAULT_CONFIG
    prefill_tp: int = 1
    decode_tp: int = 1
    requests: int = 32
    concurrency: int = 4
    pool_blocks: int | None = None
    seed: int = 0
    request_timeout_s: float = 120.0
    store_dir: str = ""
    """``--store``: the prefill sims' store directory; hits survive a rerun (every process new)."""


def run_demo(opts: DemoOptions) -> Summary:
    """Run the whole demo; progress goes to stderr, the result comes back."""
    jobs = make_jobs(opts.requests, opts.seed)
    spec = ClusterSpec(opts.config, opts.prefill_tp, opts.decode_tp, opts.pool_blocks,
                       store_dir=opts.store_dir)  # fmt: skip
    _say(f"starting prefill sim (TP {opts.prefill_tp}), decode sim (TP {opts.decode_tp}), "
         f"colocated reference sim and proxy for {opts.config} on loopback ...")  # fmt: skip
    started = time.perf_counter()
    try:
        return _run(opts, jobs, spec, started)
    except KeyboardInterrupt:
        _say("interrupted; stopped every child process")
        raise


def _run(opts: DemoOptions, jobs: list[Job], spec: ClusterSpec, started: float) -> Summary:
    with Cluster(spec) as cluster:
        assert cluster.colocated is not None
        _say(f"ready in {time.perf_counter() - started:.1f} s; proxy at {cluster.proxy_url}")
        reference = asyncio.run(reference_texts(cluster.colocated.url, cluster.model, jobs, opts))
        progress = Progress("through the proxy", len(jobs))
        begin = time.perf_counter()
        outcomes = asyncio.run(
            drive(cluster.proxy_url + "/v1", cluster.model, jobs, opts.concurrency,
                  opts.request_timeout_s, on_done=progress)
        )  # fmt: skip
        wall = time.perf_counter() - begin
        stats, unreadable = [], []
        for sim in cluster.decodes:
            try:
                stats.append(cluster.stats(sim))
            except httpx.HTTPError as exc:
                unreadable.append(f"decode sim {sim.url}: /v1/stats unreadable: {exc}")
        prefill_stats = store_stats(cluster, unreadable) if opts.store_dir else []
        _say("stopping ...")
    return summarize(
        outcomes, reference, stats, config=opts.config, prefill_tp=opts.prefill_tp,
        decode_tp=opts.decode_tp, concurrency=opts.concurrency, wall_s=wall,
        other_failures=unreadable, prefill_stats=prefill_stats,
    )  # fmt: skip


def store_stats(cluster: Cluster, unreadable: list[str]) -> list[dict[str, object]]:
    """The prefill sims' /v1/stats (their store counters); unreadable ones are failures."""
    out = []
    for sim in cluster.prefills:
        try:
            out.append(cluster.stats(sim))
        except httpx.HTTPError as exc:
            unreadable.append(f"prefill sim {sim.url}: /v1/stats unreadable: {exc}")
    return out


async def reference_texts(
    url: str, model: str, jobs: list[Job], opts: DemoOptions
) -> dict[tuple[bool, str, int], str]:
    """The colocated sim's answer to each distinct job (non-streaming); failures are absent."""
    unique = list({j.key: replace(j, stream=False) for j in jobs}.values())
    progress = Progress("colocated reference", len(unique))
    outcomes = await drive(url + "/v1", model, unique, opts.concurrency,
                           opts.request_timeout_s, on_done=progress)  # fmt: skip
    for o in outcomes:
        if not o.ok:
            _say(f"colocated reference for request {o.job.index} failed: {o.error}")
    return {o.job.key: o.text for o in outcomes if o.text is not None}


def _say(message: str) -> None:
    print(f"kvxferd demo: {message}", file=sys.stderr, flush=True)
