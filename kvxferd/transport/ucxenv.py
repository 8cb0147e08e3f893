"""UCX settings a sidecar depends on: the TCP segment sizes of this process, which pairs of them
can READ over TCP, and the memory-type cache (off, so VRAM mapped through CUDA IPC registers).

A READ over UCX's TCP transport (pods without an RDMA NIC) is emulated: the target answers with
active messages of at most ``UCX_TCP_TX_SEG_SIZE`` bytes (UCX's default 8 KiB), and the reader
receives them into ``UCX_TCP_RX_SEG_SIZE`` segments (64 KiB). A target whose segments exceed
its reader's breaks the connection: the READ fails with NIXL_ERR_REMOTE_DISCONNECT (measured
with bare agents). Operators may raise both (``1m`` moved 1.2-1.4x more per second over
loopback TCP), so sidecars state theirs in the handshake and :func:`segment_diff` refuses a pair
whose READs over TCP would break. kvxferd leaves both at UCX's defaults: over TCP the fault
campaign sees the prefill's UCX crash now and then when a reader dies mid-READ, more often with
larger segments (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

TCP_SEGMENT_VARS = ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")
UCX_DEFAULT_SEGMENTS = (8 * 1024, 64 * 1024)
"""What UCX sends and receives per TCP segment when the variables are unset (bytes)."""

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes in a UCX size such as ``1m``, ``64K``, ``8kb`` or ``8192``; 0 for what this does
    not read (``auto``, ``inf``): not known."""
    found = _SIZE.match(text)
    return int(found.group(1)) * _UNITS[found.group(2).lower()] if found else 0


def tcp_segments(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(sent, received)`` bytes per UCX TCP segment in this process (0: not known)."""
    tx, rx = (environ.get(var) for var in TCP_SEGMENT_VARS)
    return (
        UCX_DEFAULT_SEGMENTS[0] if tx is None else parse_size(tx),
        UCX_DEFAULT_SEGMENTS[1] if rx is None else parse_size(rx),
    )


def segment_diff(target_tx: int, reader_rx: int, *, local: str) -> dict[str, tuple[object, object]]:
    """Why a reader receiving ``reader_rx``-byte segments cannot READ over TCP from a target
    sending ``target_tx``-byte ones (the target answers a READ in its own segments), as
    IncompatiblePeerError fields (``local``: ``reader`` or ``target``, which one we are);
    empty when it can, or when either size is not known (0)."""
    if not (target_tx and reader_rx and target_tx > reader_rx):
        return {}
    sends, receives = f"sends {target_tx} B", f"receives {reader_rx} B"
    return {"tcp_segments": (receives, sends) if local == "reader" else (sends, receives)}


MEMTYPE_CACHE_VAR = "UCX_MEMTYPE_CACHE"


def no_memtype_cache(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn UCX's memory-type cache off unless the operator set it (call before the first
    agent); whether this set it.

    The cache learns where memory lives by hooking the allocating process's CUDA calls. A
    sidecar maps its engine's VRAM through CUDA IPC, which the cache never saw: UCX calls that
    memory host memory and NIXL refuses its VRAM registration (NIXL_ERR_BACKEND, measured on an
    H100 with ``scripts/gpu/vram_pull.py``). Without the cache UCX asks CUDA about each buffer;
    with no CUDA driver loaded there is nothing to ask.
    """
    if MEMTYPE_CACHE_VAR in environ:
        return False
    environ[MEMTYPE_CACHE_VAR] = "n"
    return True


__all__ = [
    "MEMTYPE_CACHE_VAR",
    "no_memtype_cache",
    "TCP_SEGMENT_VARS",
    "UCX_DEFAULT_SEGMENTS",
    "parse_size",
    "segment_diff",
    "tcp_segments",
]
