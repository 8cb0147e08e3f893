"""scripts/bench_engine_wire.py runs end to end and reports its ratios (not a speed test): every
hot call measured on all three wires (HTTP/JSON, HTTP/msgpack, frames) over a real sidecar's
engine sockets, the codec rows, and msgpack bodies smaller than JSON's."""

from __future__ import annotations

import pytest

from tests.benchrun import run_bench

pytestmark = pytest.mark.nixl

CALLS = {"healthz", "hold", "abort", "run_pull", "finished", "released"}


def test_a_short_run_measures_every_hot_call_on_every_wire(tmp_path):
    result, _, _ = run_bench("bench_engine_wire.py", "--iterations", "3", "--warmup", "1",
                             out=tmp_path / "wire.json")  # fmt: skip
    assert result["iterations"] == 3
    assert {r["call"] for r in result["rows"]} == CALLS
    for row in result["rows"]:
        assert row["json_p50_ms"] > 0 and row["msgpack_p50_ms"] > 0 and row["n"] == 3
        assert row["ratio"] == pytest.approx(row["msgpack_p50_ms"] / row["json_p50_ms"])
        assert row["frames_p50_ms"] > 0
        assert row["frames_ratio"] == pytest.approx(row["frames_p50_ms"] / row["json_p50_ms"])
    assert [r["blocks_per_group"] for r in result["codec"]] == [1, 1000, 8000]
    assert all(r["msgpack_bytes"] < r["json_bytes"] for r in result["codec"])
