"""What Linux tells about our children: RSS, open fds and threads from /proc, process trees,
signals to a whole tree, and the RLIMIT_NOFILE our children start with.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from dataclasses import dataclass

CHILD_NOFILE = 1024
"""Soft fd limit every child starts with (the usual distribution default), so a bounded
connection flood can reach it; the campaign raises its own limit only while it floods."""


@dataclass(frozen=True)
class Usage:
    """One process's resident memory, open file descriptors and threads."""

    rss_bytes: int
    fds: int
    threads: int


def usage(pid: int) -> Usage | None:
    """The process's usage now, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rss = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return Usage(rss, fds, int(fields.get("Threads", "0").strip()))


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/*/stat)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                rest = fh.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(rest[1]) == pid:
            out.append(int(name))
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    out, todo = [], [pid]
    while todo and len(out) < 256:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children_of(p))
    return out


def signal_tree(pids: list[int], sig: int) -> None:
    """Send ``sig`` to every pid (gone ones ignored)."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def stop(pids: list[int]) -> None:
    """SIGSTOP every pid."""
    signal_tree(pids, signal.SIGSTOP)


def cont(pids: list[int]) -> None:
    """SIGCONT every pid."""
    signal_tree(pids, signal.SIGCONT)


def limit_children_nofile() -> None:
    """Make CHILD_NOFILE our soft limit (inherited by every child we start from now)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(CHILD_NOFILE, hard), hard))


@contextlib.contextmanager
def raised_nofile(need: int):  # noqa: ANN201
    """Temporarily raise our own soft fd limit to ``need`` (capped at the hard limit); yields
    the limit in force. Start no child inside."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new = min(max(soft, need), hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    try:
        yield new
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def nofile_limit(pid: int) -> int:
    """The soft fd limit of a running process (0 when unreadable)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/limits") as fh:
        for line in fh:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return 0
