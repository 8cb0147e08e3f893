"""Cross-process READ throughput of one region in fixed-size descriptors (not a test).

Run: ``UCX_NET_DEVICES=lo .venv/bin/python -m tests.transport.bench_read [--mib 64]``
Prints GB/s (1e9 B/s) as the median over iterations of create+post+wait, per initiator
progress mode and block order, verifies the bytes, and prints a memcpy ceiling for scale.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvxferd.memory import SharedMemoryRegion  # noqa: E402
from kvxferd.transport import Agent  # noqa: E402
from tests.transport import peer as peer_main  # noqa: E402


def _run(agent, target, dst, remote_base, size, block, order, iters):
    n = size // block
    local = np.stack(
        [dst.base_addr + np.arange(n, dtype=np.uint64) * block, np.full(n, block, np.uint64)],
        axis=1,
    )
    remote = np.stack(
        [remote_base + order.astype(np.uint64) * block, np.full(n, block, np.uint64)], axis=1
    )
    rates, ndescs = [], 0
    for _ in range(iters):
        t0 = time.perf_counter()
        with agent.read(target, local, remote) as xfer:
            xfer.wait(60)
            dt = time.perf_counter() - t0
            ndescs = (xfer.telemetry() or {}).get("descriptors", -1)
        rates.append(size / dt / 1e9)
    return statistics.median(rates), min(rates), max(rates), ndescs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--desc-kib", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    size, block = args.mib << 20, args.desc_kib << 10
    src = SharedMemoryRegion.create(f"kvx-bench-src-{uuid.uuid4().hex[:6]}", size)
    dst = SharedMemoryRegion.create(f"kvx-bench-dst-{uuid.uuid4().hex[:6]}", size)
    src.host_view()[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=peer_main.serve, args=(theirs, "bench-target", src.name, size, True))
    proc.start()
    _, metadata, remote_base = ours.recv()
    n = size // block
    print(f"{args.mib} MiB in {n} x {args.desc_kib} KiB descriptors, median of {args.iters}")
    try:
        for progress in (True, False):
            with Agent(f"bench-init-{progress}", progress_thread=progress) as agent:
                agent.register(dst)
                target = agent.add_remote(metadata)
                for label, order in (
                    ("in order", np.arange(n)),
                    ("permuted", np.random.default_rng(2).permutation(n)),
                ):
                    dst.host_view()[:] = 0
                    med, lo, hi, nd = _run(
                        agent, target, dst, remote_base, size, block, order, args.iters
                    )
                    expect = src.host_view().reshape(n, block)[order].reshape(-1)
                    ok = bool(np.array_equal(dst.host_view(), expect))
                    print(
                        f"initiator progress_thread={progress!s:5} {label:8}: "
                        f"{med:6.2f} GB/s (min {lo:.2f}, max {hi:.2f}), "
                        f"nixl descs {nd}, verified={ok}"
                    )
        a, b = np.empty(size, np.uint8), src.host_view()
        t = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            np.copyto(a, b)
            t.append(size / (time.perf_counter() - t0) / 1e9)
        print(f"memcpy ceiling (np.copyto, 1 thread): {statistics.median(t):.2f} GB/s")
    finally:
        ours.send(("stop",))
        proc.join(30)
        src.close()
        dst.close()


if __name__ == "__main__":
    main()
