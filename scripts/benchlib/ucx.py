"""Raw UCX ``ucx_perftest -t ucp_get`` between two processes on loopback (the libucx wheel).

The RAPIDS ``libucx`` wheel (extra ``bench``) ships the binary and its libraries; it is found
through the installed package, run with ``LD_LIBRARY_PATH`` at its lib dir, and reports MB/s
with MB = 2**20 bytes, converted here to GB/s (1e9 B/s).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PerftestResult:
    """GB/s (None when it could not run) and why not."""

    gbps: float | None
    reason: str = ""
    message_bytes: int = 0
    iterations: int = 0
    lane: str = ""
    """UCX's protocol for the get, e.g. ``zero-copy cma/memory``."""


def locate() -> tuple[Path, Path] | str:
    """``(ucx_perftest, lib dir)`` from the installed libucx wheel, or why it is unavailable."""
    for name in ("libucx",):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        exe, lib = root / "bin" / "ucx_perftest", root / "lib"
        if exe.is_file() and os.access(exe, os.X_OK):
            return exe, lib
        return f"libucx is installed at {root} but has no executable bin/ucx_perftest"
    return "ucx_perftest not available: install the bench extra (pip install -e '.[bench]')"


def version() -> str | None:
    """The libucx wheel's version, if installed."""
    from importlib import metadata

    for dist in ("libucx-cu12", "libucx-cu13"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ucp_get(message_bytes: int, total_bytes: int) -> PerftestResult:
    """``ucp_get`` bandwidth at ``message_bytes`` per get, about ``total_bytes`` moved.

    Two processes (server and client) over loopback; warm-up is a tenth of the iterations.
    No ``-e``: with error-handling endpoints UCX 1.22 emulates get over tcp/lo, while NIXL's
    READ lane is zero-copy cma/memory; the lane used is parsed from ``UCX_PROTO_INFO`` output.
    """
    found = locate()
    if isinstance(found, str):
        return PerftestResult(None, found)
    exe, lib = found
    size = max(8, int(message_bytes))
    iters = max(20, min(100_000, -(-int(total_bytes) // size)))
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib)}
    env.setdefault("UCX_NET_DEVICES", "lo")
    args = [
        "-t",
        "ucp_get",
        "-s",
        str(size),
        "-n",
        str(iters),
        "-w",
        str(max(2, iters // 10)),
        "-v",
    ]
    port = str(_free_port())
    server = subprocess.Popen(
        [str(exe), "-p", port, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = ""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:  # the server needs a moment to listen
            client = subprocess.run(
                [str(exe), "127.0.0.1", "-p", port, *args],
                env={**env, "UCX_PROTO_INFO": "y"},
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            out = client.stdout + client.stderr
            if client.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.1)
        return _parse(out, size, iters)
    except subprocess.TimeoutExpired:
        return PerftestResult(None, f"ucx_perftest did not finish within {TIMEOUT_S:.0f} s")
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=30)
        if server.stderr is not None:
            server.stderr.close()


def _parse(out: str, size: int, iters: int) -> PerftestResult:
    """The overall bandwidth from ``-v`` CSV output: the last data line after the header."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    head: list[str] = []
    final: list[str] = []
    for line in lines:
        if line.startswith("iterations,"):
            head = line.split(",")
            continue
        row = line.split("]", 1)[1].strip() if line.startswith("[thread") else line
        vals = row.split(",")
        if head and len(vals) == len(head) and vals[0].strip().isdigit():
            final = vals
    if final and "overall_bw" in head:
        mib_s = float(final[head.index("overall_bw")])
        return PerftestResult(mib_s * 2**20 / 1e9, "", size, iters, _lane(lines))
    tail = " | ".join(lines[-3:]) if lines else "no output"
    return PerftestResult(None, f"ucx_perftest gave no bandwidth: {tail}", size, iters)


def _lane(lines: list[str]) -> str:
    """Description and config of the first row of the ucp_get protocol table, if printed."""
    for i, line in enumerate(lines):
        if "remote memory read by ucp_get" in line:
            for row in lines[i + 1 : i + 8]:
                cells = [c.strip() for c in row.split("|")[1:-1]]
                if len(cells) == 3 and cells[0] and cells[0][0].isdigit():
                    return f"{cells[1]} {cells[2]}"
    return ""
