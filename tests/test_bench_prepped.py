"""scripts/bench_prepped.py runs end to end (not a speed test): rows per config and pool size,
and real NIXL lists of the asked sizes prepared and timed."""

from __future__ import annotations

import pytest

from tests.benchrun import run_bench

pytestmark = pytest.mark.nixl


def test_a_short_run_reports_rows_and_prep_costs(tmp_path):
    result, _, _ = run_bench("bench_prepped.py", "--blocks", "64,128", "--rows", "100,1000",
                             out=tmp_path / "prepped.json")  # fmt: skip
    by_cfg = {}
    for row in result["rows"]:
        by_cfg.setdefault(row["config"], []).append(row["rows"])
    assert len(by_cfg) == 4
    assert all(a > 0 and b == 2 * a for a, b in by_cfg.values())  # rows scale with the pool
    assert [r["rows"] for r in result["prep"]] == [100, 1000]
    assert all(r["prep_local_ms"] >= 0 and r["prep_remote_ms"] >= 0 for r in result["prep"])
