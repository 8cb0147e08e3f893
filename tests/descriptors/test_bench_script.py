"""scripts/bench_descriptors.py runs and reports every case (a smoke test; no timings checked)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_descriptors.py"


def test_quick_run_writes_all_rows(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_descriptors", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--blocks", "500", "--request", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    cases = [r["case"] for r in result["rows"]]
    assert cases[0] == "build_views (whole pool)"
    assert "plan_read scattered coalesce=True" in cases
    assert result["rows"][0]["descriptors"] == 2 * 8 * 500  # two views, 8 regions, 500 blocks
    assert "build_views" in capsys.readouterr().out
