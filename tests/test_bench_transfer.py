"""scripts/bench_transfer.py --quick runs end to end and reports sane numbers (not a speed test).

It starts real sidecar processes and moves real bytes, so it is slow for a unit test (about a
minute); it checks the JSON contract of the issue, that kvxferd never uses more descriptors than
vLLM's scheme, and that a missing ucx_perftest is explained rather than silently zero.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_transfer.py"
CASE_KEYS = {
    "layout", "tokens", "pattern", "bytes", "kvxferd_gbps", "kvxferd_sidecar_gbps",
    "ceiling_gbps", "ceiling_progress_gbps", "per_layer_gbps", "per_layer_busy_gbps",
    "ucx_gbps", "ucx_reason", "memcpy_gbps", "kvxferd_descriptors", "per_layer_descriptors",
    "kvxferd_vs_ceiling", "kvxferd_vs_per_layer", "descriptor_bound", "profile_ms", "verified",
}  # fmt: skip
MEASURED = ("kvxferd_gbps", "kvxferd_sidecar_gbps", "ceiling_gbps", "ceiling_progress_gbps",
            "per_layer_gbps", "per_layer_busy_gbps", "memcpy_gbps")  # fmt: skip


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run shared by the tests of this module: (JSON result, stdout, plot path)."""
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "bench.json", tmp / "bench.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, png if "--plot" in cmd else None


def test_every_case_has_the_issue_keys_and_both_patterns(quick):
    result, _, _ = quick
    assert {"cpu_count", "cpu_model", "python", "nixl"} <= set(result["machine"])
    cases = result["cases"]
    assert {c["pattern"] for c in cases} == {"contiguous", "fragmented"}
    assert {c["layout"] for c in cases} >= {"mamba2-hybrid"}
    for c in cases:
        assert set(c) >= CASE_KEYS, CASE_KEYS - set(c)


def _reblocks(case: dict) -> bool:
    """Re-blocking cases: vLLM's per-layer scheme pairs block ids and has no such case."""
    return case["layout"].endswith("-reblock")


def test_numbers_are_measured_and_transfers_verified(quick):
    assert any(_reblocks(c) for c in quick[0]["cases"])  # the re-blocking case runs too
    for c in quick[0]["cases"]:
        assert c["verified"] is True
        assert c["bytes"] > 0
        for key in MEASURED:
            if _reblocks(c) and key.startswith("per_layer"):
                assert c[key] is None, (key, c[key])
                continue
            assert _positive(c[key]), (key, c[key])
        assert _positive(c["kvxferd_vs_ceiling"])
        assert _reblocks(c) or _positive(c["kvxferd_vs_per_layer"])
        assert _positive(c["profile_ms"]["client"]) and _positive(c["profile_ms"]["plan_read"])


def test_ucx_is_a_number_or_explained(quick):
    for c in quick[0]["cases"]:
        if c["ucx_gbps"] is None:
            assert c["ucx_reason"], c
        else:
            assert _positive(c["ucx_gbps"]) and c["ucx_reason"] == ""


def test_kvxferd_never_needs_more_descriptors_than_the_per_layer_scheme(quick):
    for c in quick[0]["cases"]:
        if _reblocks(c):  # token pieces, no per-layer table or run bound to compare with
            assert c["kvxferd_descriptors"] > 0
            continue
        assert 0 < c["kvxferd_descriptors"] <= c["per_layer_descriptors"]
        assert c["kvxferd_descriptors"] <= c["descriptor_bound"]


def test_prints_the_table_and_draws_the_plot(quick):
    _, stdout, png = quick
    assert "kx/ceil" in stdout and "plan_read" in stdout
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_kernel_tcp_ceiling_times_each_stream_count_and_ends_its_receiver():
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchlib import tcp

    link = tcp.KernelTcp(2)
    try:
        assert (
            link.send_s(np.ones(3 << 20, dtype=np.uint8)) > 0
        )  # every byte acknowledged, both streams
    finally:
        link.close()
    assert link.child.returncode == 0  # the zero-length round ended it
    best = tcp.ceiling(4 << 20, warmup=0, repeat=2)
    assert set(best["by_streams"]) == {1, 2}
    assert _positive(best["gbps"]) and best["gbps"] == pytest.approx(
        max(best["by_streams"].values()), rel=1e-2)  # fmt: skip
