#!/usr/bin/env python3
"""Does splitting one large READ across lanes beat one READ? (issue 11: past the NIXL ceiling)

A target process fills a POSIX shared-memory region of ``--mib`` MiB with a byte pattern and
registers it with a NIXL agent; this process reads all of it into a region of its own, k ways
for each k in ``--lanes``:
- ``nixl``: k agents here, each with its own UCX worker and connection, each posting one READ of
  1/k of the bytes (one descriptor) from its own thread and busy-polling it. k = 1 is the
  ceiling ``bench_transfer.py`` measures (one descriptor per region, busy-polling initiator);
- ``cma``: the same split with raw ``process_vm_readv`` and no UCX: the kernel copy UCX's cma
  transport makes on loopback, so the machine's own limit for k threads;
- ``memcpy``: numpy copies of the same bytes in k threads (memory bandwidth).
Each kind and k is checked byte for byte once. Reported: GB/s (median of ``--repeat``), each
against its kind's one lane and against one-thread memcpy.

Run: ``UCX_NET_DEVICES=lo .venv/bin/python scripts/bench_lanes.py`` (under a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvxferd.memory import SharedMemoryRegion  # noqa: E402
from kvxferd.transport import Agent, TransferState  # noqa: E402

KINDS = ("nixl", "cma", "memcpy")


def _pattern(size: int) -> np.ndarray:
    """The target's bytes: position mod 251 (a prime, so no page repeats the next)."""
    return (np.arange(size, dtype=np.uint32) % 251).astype(np.uint8)


def _serve(conn, name: str, size: int) -> None:  # noqa: ANN001  (a multiprocessing Connection)
    """Target process: the pattern in a registered region; its metadata, address and pid go
    to ``conn``; progresses its agent every millisecond until ``conn`` says stop (or closes)."""
    with (
        SharedMemoryRegion.create(name, size) as region,
        Agent(f"{name}-t", progress_thread=False) as agent,  # a progress thread spins a core
    ):
        region.host_view()[:] = _pattern(size)
        agent.register(region)
        conn.send((agent.get_agent_metadata(), region.base_addr, os.getpid()))
        while not conn.poll(0.001):  # each reader's connection is set up by both sides' progress
            agent.get_notifs()


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma_reader() -> Callable[[int, int, int, int], None] | None:
    """``read(pid, local, remote, n)`` by process_vm_readv, or None where libc lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                     ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip

    def read(pid: int, local: int, remote: int, n: int) -> None:
        done = 0
        while done < n:  # the kernel may copy less than asked (it stops at 2 GiB, or a fault)
            lo, ro = _Iovec(local + done, n - done), _Iovec(remote + done, n - done)
            got = call(pid, ctypes.byref(lo), 1, ctypes.byref(ro), 1, 0)
            if got <= 0:
                raise OSError(
                    ctypes.get_errno(), "process_vm_readv", os.strerror(ctypes.get_errno())
                )
            done += got

    return read


def _in_threads(parts: list[Callable[[], None]]) -> None:
    """Run each part on its own thread, all at once; the first error is raised."""
    errors: list[BaseException] = []

    def run(part: Callable[[], None]) -> None:
        try:
            part()
        except BaseException as exc:  # reported on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _lanes(size: int, k: int) -> list[tuple[int, int]]:
    """(offset, bytes) of k lanes over ``size`` bytes, page-aligned, the last takes the rest."""
    step = (size // k) & ~4095
    return [(i * step, step if i < k - 1 else size - i * step) for i in range(k)]


def _median_gbps(nbytes: int, fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm: connections, page tables
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def measure(mib: int, lanes: list[int], repeat: int) -> dict:
    """Every kind at every lane count; see the module docstring."""
    size = mib << 20
    name = f"kvx-lanes-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_serve, args=(there, name, size), daemon=True)
    target.start()
    rows: list[dict] = []
    try:
        if not here.poll(120):
            raise RuntimeError("the target process did not start within 120 s")
        metadata, remote_base, pid = here.recv()
        expected = _pattern(size)
        with SharedMemoryRegion.create(f"{name}-d", size) as dst:
            view = dst.host_view()
            agents = []
            try:
                for i in range(max(lanes)):
                    agent = Agent(f"{name}-r{i}", progress_thread=False)
                    agents.append(agent)
                    agent.register(dst)
                agent_remotes = [(a, a.add_remote(metadata)) for a in agents]
                cma = _cma_reader()

                def nixl_lane(i: int, off: int, n: int) -> Callable[[], None]:
                    agent, remote = agent_remotes[i]
                    loc = np.array([[dst.base_addr + off, n]], dtype=np.uint64)
                    rem = np.array([[remote_base + off, n]], dtype=np.uint64)

                    def read() -> None:
                        xfer = agent.read(remote, loc, rem)
                        try:  # busy-polled, as the ceiling's initiator
                            deadline = time.monotonic() + 60.0
                            while xfer.poll() is TransferState.POSTED:
                                if time.monotonic() > deadline:
                                    raise TimeoutError(f"READ of lane {i} not done in 60 s")
                            if xfer.state is not TransferState.DONE:
                                raise RuntimeError(f"READ of lane {i} failed: {xfer.error}")
                        finally:
                            xfer.release()

                    return read

                def cma_lane(_i: int, off: int, n: int) -> Callable[[], None]:
                    assert cma is not None
                    return lambda: cma(pid, dst.base_addr + off, remote_base + off, n)

                def memcpy_lane(_i: int, off: int, n: int) -> Callable[[], None]:
                    return lambda: np.copyto(view[off : off + n], expected[off : off + n])

                makers = {"nixl": nixl_lane, "cma": cma_lane, "memcpy": memcpy_lane}
                for kind in KINDS:
                    if kind == "cma" and cma is None:
                        continue
                    for k in lanes:
                        parts = [
                            makers[kind](i, off, n) for i, (off, n) in enumerate(_lanes(size, k))
                        ]
                        view[:] = 0
                        _in_threads(parts)
                        verified = bool(np.array_equal(view, expected))
                        gbps = _median_gbps(size, lambda parts=parts: _in_threads(parts), repeat)
                        rows.append({"kind": kind, "lanes": k, "gbps": round(gbps, 3),
                                     "verified": verified})  # fmt: skip
            finally:
                for agent in agents:
                    agent.close()
    finally:
        with contextlib.suppress(OSError):  # a target that died has no one to tell
            here.send("stop")
        target.join(30)
    for row in rows:
        one = next(r["gbps"] for r in rows if r["kind"] == row["kind"] and r["lanes"] == 1)
        memcpy = next((r["gbps"] for r in rows if r["kind"] == "memcpy" and r["lanes"] == 1), 0)
        row["vs_one_lane"] = round(row["gbps"] / one, 3) if one else None
        row["vs_memcpy"] = round(row["gbps"] / memcpy, 3) if memcpy else None
    return {"mib": mib, "lanes": lanes, "repeat": repeat, "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()), "rows": rows,
            "verified": all(r["verified"] for r in rows)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="bytes read per measurement, MiB (512)")
    p.add_argument("--lanes", default="1,2,4", help="comma list of lane counts; 1 is needed")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per measurement, median (5)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    lanes = sorted({int(x) for x in args.lanes.split(",") if x})
    if not lanes or lanes[0] != 1 or args.mib < 1 or args.repeat < 1:
        p.error("--lanes must include 1 (the baseline); --mib and --repeat must be positive")
    result = measure(args.mib, lanes, args.repeat)
    print(f"{'kind':8} {'lanes':>5} {'GB/s':>7} {'x 1 lane':>9} {'x memcpy':>9} verified")
    for r in result["rows"]:
        print(f"{r['kind']:8} {r['lanes']:5} {r['gbps']:7.2f} {r['vs_one_lane']:9.2f} "
              f"{r['vs_memcpy']:9.2f} {'yes' if r['verified'] else 'NO'}")  # fmt: skip
    print(f"{args.mib} MiB per READ, {result['cpus']} CPUs, load average "
          f"{[round(x, 2) for x in result['load_average']]}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
