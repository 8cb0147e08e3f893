"""Readers killed mid-READ over UCX's TCP: does the agent they read from survive?

Over TCP, UCX emulates a READ: the target sends the bytes back as GET replies, which wait in its
endpoint's pending queue while the socket is full. When the reader dies, the target's UCX
purges that queue and, in the UCX that nixl 1.5.1 bundles, can crash there (SIGSEGV in
``ucp_request_memory_dereg``, from ``uct_tcp_ep_pending_purge`` during ``ucp_worker_progress``:
in a sidecar, inside ``get_notifs``). UCX's error handling mode and NIXL's thread sync mode make
no difference (measured). This script reproduces it in seconds, to recheck a newer nixl.

One target process (an ``Agent``, no progress thread, polling notifications every millisecond
as the sidecar does) registers a shared-memory region; reader processes READ all of it, again
and again, and are SIGKILLed a random while after they posted. If the target survives, a fresh
reader READs the region once more and checks every byte. Prints one JSON line; exits 1 when the
target died or that READ was wrong. UCX_TLS defaults to ``tcp`` and UCX_NET_DEVICES to ``lo``.

    PYTHONPATH=$PWD python scripts/ucx_reader_death.py --kills 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvxferd.memory import SharedMemoryRegion
from kvxferd.memory.shm import SHM_DIR
from kvxferd.transport import Agent

PATTERN = 0x5A
"""Every byte of the target's region."""
DESCS = 64
"""Descriptors per READ (the region in equal pieces)."""
READER_LIFE_S = 120
"""A reader process ends (SIGALRM) after this long, killed or not."""


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"ucx_reader_death: {path.name} did not appear in {timeout_s:.0f} s")
        time.sleep(0.01)


def _unlink(shm: str) -> None:
    """Remove a killed process's segment (a SIGKILLed owner cannot)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, shm))


def serve(work: Path, size: int, shm: str) -> None:
    """The target: register, publish metadata and base address, poll until told to stop."""
    with (
        Agent("target", progress_thread=False) as agent,
        SharedMemoryRegion.create(shm, size) as region,
    ):
        region.host_view()[:] = PATTERN
        agent.register(region)
        tmp = work / "target.tmp"
        tmp.write_bytes(agent.get_agent_metadata())
        (work / "base").write_text(str(region.base_addr))
        tmp.rename(work / "target.meta")
        stop = work / "stop"
        while not stop.exists():
            agent.get_notifs()
            time.sleep(0.001)


def read(work: Path, size: int, index: int, shm: str, verify: bool) -> None:
    """A reader: READ the whole region in DESCS pieces, forever (or once, checking bytes)."""
    signal.alarm(READER_LIFE_S)  # a reader that hangs ends by itself, so the campaign ends too
    with (
        Agent(f"reader{index}", progress_thread=False) as agent,
        SharedMemoryRegion.create(shm, size) as region,
    ):
        agent.register(region)
        remote = agent.add_remote((work / "target.meta").read_bytes())
        base = int((work / "base").read_text())
        piece = size // DESCS
        offsets = np.arange(DESCS, dtype=np.uint64) * np.uint64(piece)
        lens = np.full(DESCS, piece, dtype=np.uint64)
        local = (np.uint64(region.base_addr) + offsets, lens)
        theirs = (np.uint64(base) + offsets, lens)
        while True:
            with agent.read(remote, local, theirs, b"read") as xfer:
                print("posted", flush=True)
                state = xfer.wait(60.0)
            if verify:
                view = region.host_view()[: piece * DESCS]
                print(f"verified {state.name} {bool((view == PATTERN).all())}", flush=True)
                return


def _reader(work: Path, size: int, index: int, verify: bool) -> subprocess.Popen[str]:
    argv = [sys.executable, __file__, "--role", "reader", "--work", str(work),
            "--mib", str(size >> 20), "--index", str(index), "--shm", _shm(index)]  # fmt: skip
    return subprocess.Popen(
        argv + (["--verify"] if verify else []),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip


def _shm(index: int | str) -> str:
    return f"kvx-death-{os.getpid()}-{index}"


def _first(proc: subprocess.Popen[str], prefix: str) -> str:
    """The first stdout line starting with ``prefix`` ("" if the process ended first)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    return ""


def campaign(args: argparse.Namespace) -> dict[str, object]:
    """Run the target, kill readers mid-READ ``args.kills`` times, then verify one READ."""
    size = args.mib << 20
    rnd = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvx-death-") as tmp:
        work = Path(tmp)
        log = (work / "target.log").open("w")  # a pipe could fill and stall the target
        target = subprocess.Popen(
            [sys.executable, __file__, "--role", "target", "--work", tmp, "--mib", str(args.mib),
             "--shm", _shm("target")],
            stdout=subprocess.DEVNULL, stderr=log, text=True,
        )  # fmt: skip
        _wait_for(work / "target.meta", 60)
        kills = 0
        for round_ in range(args.kills):
            readers = [_reader(work, size, round_ * args.readers + i, False)
                       for i in range(args.readers)]  # fmt: skip
            for proc in readers:
                _first(proc, "posted")
            time.sleep(rnd.uniform(0.0, args.max_delay_ms / 1000))  # mid-READ, at random
            for i, proc in enumerate(readers):
                proc.kill()
                proc.wait()
                _unlink(_shm(round_ * args.readers + i))
            kills += len(readers)
            if target.poll() is not None:
                break
        verified = ""
        if target.poll() is None:
            checker = _reader(work, size, 1 << 20, True)
            verified = _first(checker, "verified")
            checker.kill()
            checker.wait()
            _unlink(_shm(1 << 20))
        (work / "stop").touch()
        try:
            code = target.wait(timeout=30)
        except subprocess.TimeoutExpired:
            target.kill()
            code = target.wait()
        _unlink(_shm("target"))
        log.close()
        stderr = (work / "target.log").read_text(errors="replace")
    died = code != 0
    return {
        "ucx_tcp_seg_sizes": [
            os.environ.get("UCX_TCP_TX_SEG_SIZE", ""),
            os.environ.get("UCX_TCP_RX_SEG_SIZE", ""),
        ],
        "ucx_tls": os.environ.get("UCX_TLS", ""),
        "readers_killed": kills,
        "target_exit": code,
        "target_died": died,
        "target_signal": signal.Signals(-code).name if code < 0 else "",
        "verified": verified == "verified DONE True",
        "target_stderr_tail": stderr[-400:] if died else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Kill READ initiators mid-READ over UCX TCP and check that their target "
        "survives and still serves correct bytes.",
    )
    parser.add_argument("--kills", type=int, default=40, help="rounds of kills (default 40)")
    parser.add_argument("--readers", type=int, default=2, help="readers per round (default 2)")
    parser.add_argument("--mib", type=int, default=64, help="MiB each READ moves (default 64)")
    parser.add_argument("--max-delay-ms", type=float, default=80.0,
                        help="kill each reader up to this long after it posted")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1, help="random seed of the kill delays")
    parser.add_argument("--role", choices=("campaign", "target", "reader"), default="campaign",
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kills < 1 or args.readers < 1 or args.mib < 1:
        parser.error("--kills, --readers and --mib must be at least 1")
    os.environ.setdefault("UCX_TLS", "tcp")  # the emulated READ is what crashes
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.role == "target":
        serve(Path(args.work), args.mib << 20, args.shm)
    elif args.role == "reader":
        read(Path(args.work), args.mib << 20, args.index, args.shm, args.verify)
    else:
        report = campaign(args)
        print(json.dumps(report))
        sys.exit(1 if report["target_died"] or not report["verified"] else 0)


if __name__ == "__main__":
    main()
