"""scripts/bench_pulls.py --quick runs end to end and reports sane numbers (not a speed test).

It starts a real decode sidecar and prefill sidecars (TP 1 and 2) over real NIXL on loopback,
so it takes 20-40 s; it checks the JSON contract (both sweeps, targets, machine), that every
rate, latency and CPU figure is measured, that every pull of the verified rounds was checked
byte for byte, and that the fan-in pulls moved the same bytes from 2 ranks as from 1.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_pulls.py"
ROW_KEYS = {
    "inflight", "prefill_tp", "pulls", "bytes_per_pull", "pulls_per_s", "p50_ms", "p99_ms",
    "sidecar_p50_ms", "decode_cpu_ms_per_pull", "prefill_cpu_ms_per_pull", "verified_pulls",
    "decode_phase_mean_ms",
}  # fmt: skip
MEASURED = ("pulls_per_s", "p50_ms", "p99_ms", "sidecar_p50_ms")
CPU = ("decode_cpu_ms_per_pull", "prefill_cpu_ms_per_pull")
"""Read from /proc in clock ticks (10 ms): a quick level's prefill (~0.3 ms a pull) may use
less than one tick, so a single level may read 0."""


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run shared by the tests of this module: (JSON result, stdout)."""
    out = tmp_path_factory.mktemp("bench-pulls") / "pulls.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_result_has_machine_both_sweeps_and_targets(quick):
    result, _ = quick
    assert {"cpu_count", "load_average_start", "load_average_end"} <= set(result["machine"])
    s = result["settings"]
    assert [r["inflight"] for r in result["inflight"]] == s["inflight"]
    assert [r["prefill_tp"] for r in result["fanin"]] == s["fanin"]
    for row in result["inflight"] + result["fanin"]:
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
    assert {"inflight_non_decreasing", "fanin_cost_ratio", "fanin_met"} <= set(result["targets"])


def test_every_level_is_measured(quick):
    result, _ = quick
    rows = result["inflight"] + result["fanin"]
    for row in rows:
        for key in MEASURED:
            assert _positive(row[key]), (key, row[key])
        for key in CPU:
            assert _positive(row[key]) or row[key] == 0, (key, row[key])
    assert _positive(sum(row["decode_cpu_ms_per_pull"] for row in rows))
    for row in rows:
        assert row["p99_ms"] >= row["p50_ms"]
        assert row["pulls"] >= 2 * row["inflight"]
        assert _positive(row["decode_phase_mean_ms"]["total"])
        assert _positive(row["decode_phase_mean_ms"]["claim"])


def test_every_pull_of_the_verified_rounds_was_checked_byte_for_byte(quick):
    result, _ = quick
    assert result["verified"] is True
    for row in result["inflight"] + result["fanin"]:
        # the warm-up round (same size as a timed one) is verified in full
        assert row["verified_pulls"] >= row["pulls"] // row["rounds"]


def test_fan_in_moves_the_same_bytes_from_every_tp_and_reports_the_cost_ratio(quick):
    result, stdout = quick
    fan = result["fanin"]
    assert len({r["bytes_per_pull"] for r in fan + result["inflight"]}) == 1
    assert fan[0]["prefill_tp"] == 1 and fan[0]["cost_vs_tp1"] == 1.0
    for r in fan:
        assert r["cost_vs_tp1"] == pytest.approx(fan[0]["pulls_per_s"] / r["pulls_per_s"])
    assert result["targets"]["fanin_cost_ratio"] == fan[-1]["cost_vs_tp1"]
    assert "in-flight sweep" in stdout and "fan-in sweep" in stdout
