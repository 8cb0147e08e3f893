"""``/dev/shm`` for the campaign: a private tmpfs in a private mount namespace when we may make
one (root + ``unshare -m``), so leftovers are counted exactly and ``/dev/shm`` can be filled
without touching anyone else; else the host's ``/dev/shm``, watched by name prefix only.

The campaign re-executes itself under ``unshare -m --propagation private`` and mounts the tmpfs
first thing (``enter_private``); every child inherits the namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

SHM_DIR = "/dev/shm"
ENV_FLAG = "KVXFERD_CAMPAIGN_PRIVATE_SHM"
PRIVATE_SIZE = "512m"
FILLER = "campaign-filler"


def reexec_private(argv: list[str]) -> None:
    """Replace this process by itself inside a private mount namespace (returns if we cannot)."""
    if os.environ.get(ENV_FLAG) or os.geteuid() != 0 or shutil.which("unshare") is None:
        return
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, timeout=30)  # fmt: skip
    if probe.returncode != 0:
        return
    os.environ[ENV_FLAG] = "1"
    sys.stdout.flush()
    os.execvp("unshare", ["unshare", "-m", "--propagation", "private", sys.executable, *argv])


def enter_private() -> str:
    """Mount our private tmpfs on /dev/shm when re-executed for it; returns why we could not
    ("" when /dev/shm is private)."""
    if os.environ.get(ENV_FLAG) != "1":
        return "not root or no unshare: /dev/shm is the host's (shm_full skipped)"
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={PRIVATE_SIZE},mode=1777", "campaign-shm", SHM_DIR]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"mount tmpfs on /dev/shm failed: {done.stderr.strip()}"
    os.environ[ENV_FLAG] = "mounted"
    return ""


def is_private() -> bool:
    """Whether /dev/shm is our own tmpfs."""
    return os.environ.get(ENV_FLAG) == "mounted"


def entries() -> set[str]:
    """Names in /dev/shm now."""
    with contextlib.suppress(FileNotFoundError):
        return set(os.listdir(SHM_DIR))
    return set()


def fill(leave_bytes: int) -> int:
    """Fill the private /dev/shm until ``leave_bytes`` are free; returns bytes written."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    size = max(0, free - leave_bytes)
    fd = os.open(os.path.join(SHM_DIR, FILLER), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return size


def unfill() -> None:
    """Remove the filler."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, FILLER))
