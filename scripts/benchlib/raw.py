"""The baselines driven through NIXL directly, and memcpy, over the same memory as the pull.

The bench process plays a decode rank without a sidecar: it registers the decode pool (the same
shm segments the decode sidecar registered), handshakes with the *prefill sidecar* over its peer
API to get its NIXL metadata and region bases, and READs from the memory that sidecar serves.
So the target process, its progress thread and the bytes are those of the kvxferd pull.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable

import httpx
import msgspec
import numpy as np

from kvxferd.descriptors import ReadPlan
from kvxferd.transport import Agent
from kvxferd.wire import PROTOCOL_VERSION, Handshake, Manifest

from .faults.peerauth import peer_headers
from .procs import TOKEN, Pool


class RawReader:
    """A NIXL initiator in the bench process, connected to one prefill sidecar.

    ``progress_thread=False`` busy-polls completions (the fastest initiator on 2 cores);
    ``True`` is the configuration the sidecars (and vLLM's connector) run with.
    """

    def __init__(self, peer: str, manifest: Manifest, pool: Pool, progress_thread: bool) -> None:
        name = f"bench-{'prog' if progress_thread else 'busy'}-{uuid.uuid4().hex[:8]}"
        self.agent = Agent(name, progress_thread=progress_thread)
        try:
            self.agent.register(pool.segments)
            mine = Handshake(
                protocol_version=PROTOCOL_VERSION,
                engine_id=name,
                epoch=1,
                agent_name=name,
                agent_metadata=self.agent.get_agent_metadata(),
                manifest=manifest,
                region_bases=[int(b) for b in pool.bases],
            )
            body = msgspec.json.encode(mine)
            auth = peer_headers("POST", "/v1/handshake", body, TOKEN)["Authorization"]
            resp = httpx.post(
                f"http://{peer}/v1/handshake",
                content=body,
                headers={"Authorization": auth, "Content-Type": "application/json"},
                timeout=60,
            )
            resp.raise_for_status()
            theirs = msgspec.json.decode(resp.content, type=Handshake)
            self.remote = self.agent.add_remote(theirs.agent_metadata)
        except BaseException:
            self.agent.close()
            raise
        self.remote_bases = np.asarray(theirs.region_bases, dtype=np.int64)
        self.local_bases = pool.bases

    def read_s(self, plan: ReadPlan, timeout_s: float = 120.0) -> float:
        """Seconds for one READ of ``plan``: address table + descriptor lists + post + wait."""
        t0 = time.perf_counter()
        local = self.local_bases[plan.local_region] + plan.local_offset
        remote = self.remote_bases[plan.remote_region] + plan.remote_offset
        with self.agent.read(self.remote, (local, plan.length), (remote, plan.length)) as xfer:
            xfer.wait(timeout_s)
            return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the peer and free the agent."""
        self.agent.close()


def region_volumes(plan: ReadPlan, num_regions: int) -> np.ndarray:
    """Bytes the plan writes into each local region."""
    return np.bincount(plan.local_region, weights=plan.length, minlength=num_regions).astype(
        np.int64
    )


def ceiling_plan(
    plan: ReadPlan, num_regions: int, num_remote_regions: int | None = None
) -> ReadPlan:
    """The plan's volume in the fewest descriptors: each side's regions filled from offset 0
    with the bytes the plan moves there, cut where either side moves to its next region.

    With regions that match one to one (same volumes), one descriptor per region. When the
    sides' regions differ (re-blocking between other groupings), at most ``L + R - 1``.
    """
    lvol = region_volumes(plan, num_regions)
    rvol = np.bincount(
        plan.remote_region, weights=plan.length, minlength=num_remote_regions or num_regions
    ).astype(np.int64)
    lreg, rreg = np.flatnonzero(lvol), np.flatnonzero(rvol)
    lend, rend = np.cumsum(lvol[lreg]), np.cumsum(rvol[rreg])
    cuts = np.union1d(lend, rend)
    starts = np.concatenate(([0], cuts[:-1]))
    li = np.searchsorted(lend, starts, side="right")
    ri = np.searchsorted(rend, starts, side="right")
    lbase = np.concatenate(([0], lend[:-1]))[li]
    rbase = np.concatenate(([0], rend[:-1]))[ri]
    return ReadPlan(lreg[li].astype(np.int64), (starts - lbase).astype(np.int64),
                    rreg[ri].astype(np.int64), (starts - rbase).astype(np.int64),
                    (cuts - starts).astype(np.int64), plan.kv_bytes, plan.state_bytes)  # fmt: skip


def memcpy_s(src: list[np.ndarray], dst: list[np.ndarray], ceiling: ReadPlan) -> float:
    """Seconds for one ``np.copyto`` (one thread) of each :func:`ceiling_plan` descriptor."""
    t0 = time.perf_counter()
    for lr, lo, rr, ro, n in zip(ceiling.local_region.tolist(), ceiling.local_offset.tolist(),
                                 ceiling.remote_region.tolist(), ceiling.remote_offset.tolist(),
                                 ceiling.length.tolist(), strict=True):  # fmt: skip
        np.copyto(dst[lr][lo : lo + n], src[rr][ro : ro + n])
    return time.perf_counter() - t0


def median_gbps(nbytes: int, fn: Callable[[], float], warmup: int, repeat: int) -> dict:
    """Run ``fn`` (returns seconds) warmup + repeat times: median GB/s (1e9 B/s) and samples."""
    for _ in range(warmup):
        fn()
    secs = [fn() for _ in range(repeat)]
    rates = [nbytes / s / 1e9 for s in secs]
    return {
        "gbps": statistics.median(rates),
        "samples_gbps": [round(r, 3) for r in rates],
        "median_s": statistics.median(secs),
    }
