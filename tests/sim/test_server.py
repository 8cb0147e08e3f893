"""Startup housekeeping of ``kvxferd sim``: socket dirs of killed sims are swept."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from kvxferd.sim.server import _sweep_stale_dirs


def test_dirs_of_dead_sims_are_swept_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tempfile.mkdtemp(prefix=f"kvxferd-sim-{dead.pid}-")
    kept = tempfile.mkdtemp(prefix=f"kvxferd-sim-{os.getpid()}-")
    open(os.path.join(gone, "x.sock"), "w").close()
    try:
        _sweep_stale_dirs()
        assert not os.path.exists(gone)
        assert os.path.isdir(kept)
    finally:
        os.rmdir(kept)
