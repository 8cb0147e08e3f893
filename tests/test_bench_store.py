"""scripts/bench_store.py --quick runs end to end and reports sane numbers (not a speed test):
every case has the keys of the issue, every measured figure is positive, loads were verified."""

from __future__ import annotations

import math

import pytest

from tests.benchrun import run_bench

MEASURED = ("save_file_gbps", "load_file_gbps", "file_write_gbps", "file_read_gbps",
            "save_dram_gbps", "load_dram_gbps", "memcpy_gbps", "crc32_gbps")  # fmt: skip
RATIOS = ("save_file_vs_ceiling", "load_file_vs_ceiling", "save_dram_vs_memcpy",
          "load_dram_vs_memcpy")  # fmt: skip


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    result, stdout, png = run_bench("bench_store.py", "--quick", "--dir", str(tmp),
                                    out=tmp / "store.json", plot=tmp / "store.png",
                                    timeout_s=270)  # fmt: skip
    return result, stdout, png, tmp


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
