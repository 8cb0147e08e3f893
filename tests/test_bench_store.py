"""scripts/bench_store.py --quick runs end to end and reports sane numbers (not a speed test):
every case has the keys of the issue, every measured figure is positive, loads were verified."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_store.py"
MEASURED = ("save_file_gbps", "load_file_gbps", "file_write_gbps", "file_read_gbps",
            "save_dram_gbps", "load_dram_gbps", "memcpy_gbps", "crc32_gbps")  # fmt: skip
RATIOS = ("save_file_vs_ceiling", "load_file_vs_ceiling", "save_dram_vs_memcpy",
          "load_dram_vs_memcpy")  # fmt: skip


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "store.json", tmp / "store.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--dir", str(tmp)]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, png if "--plot" in cmd else None, tmp


def test_every_case_reports_positive_figures_and_ratios(quick):
    result, *_ = quick
    assert {"cpu_count", "python"} <= set(result["machine"])
    assert result["cases"]
    for case in result["cases"]:
        for key in (*MEASURED, *RATIOS):
            assert math.isfinite(case[key]) and case[key] > 0, key
        assert case["verified"] is True
        assert case["payload_bytes"] == case["kv_bytes"] + case["state_bytes"] > 0
        assert case["entry_bytes"] > case["payload_bytes"]  # headers on top of the payload
        assert case["state_bytes"] > 0  # the quick layout is a hybrid


def test_table_and_plot_are_written_and_files_removed(quick):
    _, stdout, png, tmp = quick
    assert "save-f" in stdout and "rd-ceil" in stdout
    if png is not None:
        assert png.stat().st_size > 0
    assert not list(tmp.glob("kvx-store-bench-*"))  # its files are removed
