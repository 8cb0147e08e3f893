"""UCX settings kvxferd picks when the environment leaves them unset.

UCX reads its ``UCX_*`` variables when NIXL creates the UCX backend, so :func:`apply` runs just
before that, in every agent of the process. An operator's own values always win.

TCP segments. A READ over UCX's TCP transport (pods without an RDMA NIC) is emulated: the
target answers with active messages of at most ``UCX_TCP_TX_SEG_SIZE`` bytes (UCX default 8 KiB,
received into 64 KiB segments). Over loopback TCP, ``1m`` alone moved 1.2-1.4x more per second,
and with the reader polling every loop round (transport/completion.py) 2.1-2.8 GB/s against 1.2
(docs/benchmarks.md), sidecar memory unchanged. A target whose segments exceed its reader's
``UCX_TCP_RX_SEG_SIZE`` breaks the connection (NIXL_ERR_REMOTE_DISCONNECT on the READ), so both
are set together, and only when neither is set: every kvxferd agent then sends and receives the
same size. UCX refuses an RX size below the TX size in one process. Where operators set them
per pod, sidecars state theirs in the handshake and :func:`segment_diff` refuses a pair whose
READs over TCP would break.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping

TCP_SEGMENT = "1m"
"""``UCX_TCP_TX_SEG_SIZE`` and ``UCX_TCP_RX_SEG_SIZE`` when the environment sets neither."""
TCP_SEGMENT_VARS = ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")
UCX_DEFAULT_SEGMENTS = (8 * 1024, 64 * 1024)
"""What UCX sends and receives per TCP segment when the variables are unset (bytes)."""

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set kvxferd's UCX defaults in ``environ`` where it sets none; what was set."""
    chosen: dict[str, str] = {}
    if not any(var in environ for var in TCP_SEGMENT_VARS):
        chosen = dict.fromkeys(TCP_SEGMENT_VARS, TCP_SEGMENT)
    environ.update(chosen)
    return chosen


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


__all__ = [
    "TCP_SEGMENT",
    "TCP_SEGMENT_VARS",
    "UCX_DEFAULT_SEGMENTS",
    "apply",
    "parse_size",
    "segment_diff",
    "tcp_segments",
]
