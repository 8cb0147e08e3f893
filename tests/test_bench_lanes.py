"""scripts/bench_lanes.py runs end to end (not a speed test): one READ and the same bytes split
across lanes, through NIXL, raw process_vm_readv and memcpy, every variant byte-verified."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.benchrun import ROOT, run_bench

pytestmark = pytest.mark.nixl


def test_a_short_run_reads_every_byte_each_way(tmp_path):
    result, stdout, _ = run_bench("bench_lanes.py", "--mib", "8", "--lanes", "1,2",
                                  "--repeat", "1", out=tmp_path / "lanes.json")  # fmt: skip
    assert result["verified"] is True
    kinds = {(r["kind"], r["lanes"]) for r in result["rows"]}
    assert {("nixl", 1), ("nixl", 2), ("memcpy", 1), ("memcpy", 2)} <= kinds
    assert all(r["gbps"] > 0 and r["verified"] for r in result["rows"])
    assert all(r["vs_one_lane"] == 1.0 for r in result["rows"] if r["lanes"] == 1)
    assert "x 1 lane" in stdout


def test_lanes_without_the_one_lane_baseline_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_lanes.py"), "--lanes",
                           "2,4"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--lanes must include 1" in proc.stderr
