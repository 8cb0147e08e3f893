"""scripts/bench_store_index.py runs end to end and reports sane numbers (not a speed test):
one row per padding count, every figure positive, the ceiling (a listdir) taken in the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_store_index.py"


def test_every_row_reports_positive_figures_against_a_listdir(tmp_path):
    out = tmp_path / "index.json"
    args = ["--files", "0,50", "--tokens", "256", "--repeat", "1", "--calls", "3"]
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--dir", str(tmp_path),
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["files"] for r in rows] == [0, 50]
    for row in rows:
        for k in ("listdir_us", "hit_us", "miss_us", "after_change_us", "lookup_ms", "load_ms"):
            assert math.isfinite(row[k]) and row[k] > 0, k
        assert row["hit_vs_listdir"] == row["hit_us"] / row["listdir_us"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kvx-index-bench-")]
