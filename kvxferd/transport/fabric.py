"""Which UCX transports READs actually use, read from UCX's own protocol-selection log.

NIXL 1.5.1 does not say which transport a connection uses. UCX does: with ``UCX_PROTO_INFO=y``
it logs, per endpoint configuration, a table of the protocols it selected (e.g. ``remote
memory read by ucp_get*`` served by ``cma/memory``, ``tcp/lo`` or ``rc_mlx5/mlx5_0:1``), and
``UCX_LOG_FILE`` sends that log to a file. :func:`enable` sets both before the first agent of
the process is created (UCX reads them when it loads); :class:`ProtoLog` follows the file and
reports the transports seen for READs (``ucp_get``) and for notifications (active messages).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

RDMA_PREFIXES = ("rc", "ud", "dc", "ib", "srd", "gga")
"""UCX transport names (before ``_``) that run over an RDMA NIC (verbs, mlx5, EFA)."""

_TITLE = re.compile(r"\|\s*(?P<id>\S+)\s+(?P<peer>[^|]*?)\s+cfg#(?P<cfg>\d+)\s*\|")
_LANE = re.compile(r"[a-z][a-z0-9_]*/[\w:.\-]+")
_ROW = re.compile(r"\|\s*[\d.]+(?:\s*\.\.\s*\w+)?\s*\|[^|]*\|\s*(?P<cfg>[^|]*?)\s*\|\s*$")


def kind(transport: str) -> str:
    """``rdma``, ``tcp``, ``cma``, ``cuda_ipc``, ``shm`` (sysv/posix/xpmem/knem), ``self`` or the
    transport name itself, for a UCX transport such as ``rc_mlx5`` or ``tcp``."""
    name = transport.split("/", 1)[0].strip().lower()
    if name.split("_", 1)[0] in RDMA_PREFIXES:
        return "rdma"
    if name in ("sysv", "posix", "xpmem", "knem", "mm"):
        return "shm"
    if name.startswith("cuda_ipc"):
        return "cuda_ipc"
    return name


def enable(path: str | os.PathLike[str]) -> Path | None:
    """Ask UCX to log its protocol choices (and its warnings) to the file ``path``; the path.

    Does nothing (None) when the environment already sets ``UCX_LOG_FILE`` or turns
    ``UCX_PROTO_INFO`` off: an operator's own UCX logging wins. Call before the first agent;
    :meth:`ProtoLog.scan` passes UCX's warnings and errors on to the log.
    """
    if "UCX_LOG_FILE" in os.environ or os.environ.get("UCX_PROTO_INFO", "y").lower() in (
        "n", "no", "0", "off",
    ):  # fmt: skip
        return None
    path = Path(path)
    os.environ["UCX_PROTO_INFO"] = "y"
    os.environ["UCX_LOG_FILE"] = str(path)
    return path


@dataclass
class Lanes:
    """Transports UCX selected, by endpoint kind (``self``, ``intra-node``, ``inter-node``...)."""

    reads: dict[str, set[str]] = field(default_factory=dict)
    """Transports of ``ucp_get`` (one-sided READ) tables."""
    messages: dict[str, set[str]] = field(default_factory=dict)
    """Transports of active-message tables (notifications, acknowledgements)."""

    def read_kinds(self, *, peers_only: bool = True) -> set[str]:
        """:func:`kind` of every READ transport (of connections to other agents by default)."""
        return {
            kind(t)
            for ep, ts in self.reads.items()
            if not (peers_only and ep == "self")
            for t in ts
        }


def _flush_stdio() -> None:
    # Without libc symbols (not glibc/musl) read what is there.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


class ProtoLog:
    """Follows a UCX protocol-info log file; thread-safe, reads only what is new."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = ""
        self._title: tuple[str, str] | None = None  # (endpoint, operation) of the open table
        self.lanes = Lanes()

    def scan(self) -> Lanes:
        """Parse what was appended since the last call; the transports seen so far.

        UCX writes the file through a buffered stdio stream, so this process's streams are
        flushed first (``fflush(NULL)``); a file written by another process is read as it is.
        """
        _flush_stdio()
        with self._lock:
            try:
                with self.path.open("r", errors="replace") as fh:
                    fh.seek(self._offset)
                    text = fh.read()
                    self._offset = fh.tell()
            except FileNotFoundError:
                return self.lanes
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._line(line)
            return self.lanes

    def _line(self, line: str) -> None:
        body = line.split("]", 2)[-1] if line.startswith("[") else line
        if "|" not in body and ("UCX  ERROR" in body or "UCX  WARN" in body):
            log.warning("ucx: %s", body.strip())  # UCX_LOG_FILE took them off stderr
            return
        title = _TITLE.search(body)
        if title is not None and "cfg#" in body:
            peer = title.group("peer").strip()
            self._title = (peer, "")
            return
        if self._title is not None and not self._title[1]:
            cell = body.strip().strip("|").strip()
            if cell and not cell.startswith("+") and "Range" not in cell:
                self._title = (self._title[0], cell)
            return
        row = _ROW.search(body)
        if row is None or self._title is None:
            return
        endpoint, operation = self._title
        found = {m.group(0) for m in _LANE.finditer(row.group("cfg"))}
        if "ucp_get" in operation:
            self.lanes.reads.setdefault(endpoint, set()).update(found)
        elif "active message" in operation:
            self.lanes.messages.setdefault(endpoint, set()).update(found)
