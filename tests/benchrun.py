"""Running a ``scripts/bench_*.py`` the way a user does, for the tests that check a short run
end to end (not speed): UCX on loopback, a bounded run, exit 0, its ``--json`` result."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(
    script: str, *args: str, out: Path, timeout_s: float = 300, plot: Path | None = None
) -> tuple[dict, str, Path | None]:
    """Run ``scripts/<script> ARGS --json OUT`` (and ``--plot PLOT`` where matplotlib is
    installed); (the JSON result, stdout, the plot's path or None)."""
    cmd = [sys.executable, str(ROOT / "scripts" / script), *args, "--json", str(out)]
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        plot = None
    if plot is not None:
        cmd += ["--plot", str(plot)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, plot
