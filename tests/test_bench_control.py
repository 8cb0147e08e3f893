"""scripts/bench_control.py --quick runs end to end and reports sane numbers (not a speed test).

It starts a real prefill sim, decode sim (each with its sidecar) and the proxy, so it takes
10-30 s; it checks the JSON contract (levels, profile, target, machine), that every latency and
rate is measured and positive, that every P/D request pulled and verified its bytes, and that
the overheads are the differences the issue defines.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_control.py"
LEVEL_KEYS = {
    "concurrency", "rps", "p50_ms", "p99_ms", "direct_p50_ms", "local_p50_ms",
    "proxy_overhead_p50_ms", "pd_overhead_p50_ms", "direct_rps", "local_rps", "direct_p99_ms",
    "local_p99_ms", "load_average", "cpu_cores",
}  # fmt: skip
MEASURED = ("rps", "p50_ms", "p99_ms", "direct_p50_ms", "local_p50_ms", "direct_rps",
            "local_rps")  # fmt: skip


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick run shared by the tests of this module: (JSON result, stdout, plot path)."""
    tmp = tmp_path_factory.mktemp("bench-control")
    out, png = tmp / "control.json", tmp / "control.png"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", str(png)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, png if "--plot" in cmd else None


def test_result_has_machine_levels_profile_and_target(quick):
    result, _, _ = quick
    assert {"cpu_count", "cpu_model", "python", "load_average_start", "load_average_end"} <= set(
        result["machine"]
    )
    assert [lv["concurrency"] for lv in result["levels"]] == result["settings"]["concurrency"]
    for lv in result["levels"]:
        assert set(lv) >= LEVEL_KEYS, LEVEL_KEYS - set(lv)
    assert set(result["target"]) >= {"pd_overhead_p50_ms", "target_ms", "met"}
    assert result["target"]["target_ms"] == 3.0


def test_every_level_is_measured_and_overheads_are_the_differences(quick):
    for lv in quick[0]["levels"]:
        for key in MEASURED:
            assert _positive(lv[key]), (key, lv[key])
        assert lv["p99_ms"] >= lv["p50_ms"]
        assert lv["requests"] == quick[0]["settings"]["requests"]
        assert lv["proxy_overhead_p50_ms"] == pytest.approx(lv["p50_ms"] - lv["direct_p50_ms"])
        assert lv["pd_overhead_p50_ms"] == pytest.approx(lv["p50_ms"] - lv["local_p50_ms"])
        assert set(lv["cpu_cores"]) >= {"ours", "others", "steal", "total", "by_process"}


def test_every_pd_request_pulled_and_verified_its_bytes(quick):
    result = quick[0]
    c = result["decode_counters"]
    assert c["pulls_ok"] > 0 and c["verified_ok"] == c["pulls_ok"]
    assert c["pulls_failed"] == 0 and c["verified_failed"] == 0 and c["prefix_hits"] == 0
    assert 0 < result["settings"]["kv_bytes_per_request"] <= 64 * 1024  # tiny: a few KiB


def test_profile_breaks_down_one_request(quick):
    prof = quick[0]["profile"]
    for key in ("http_floor", "prefill_local", "decode_local", "direct_prefill",
                "direct_decode", "proxy_total"):  # fmt: skip
        assert _positive(prof["p50_ms"][key]), key
    assert prof["pulls"] == 2 * prof["requests"] and prof["pulls_failed"] == 0
    d = prof["derived_ms"]
    p = prof["p50_ms"]
    assert d["pd_overhead"] == pytest.approx(p["proxy_total"] - p["decode_local"])
    phases = prof["pull_sidecar_mean_ms"]
    if phases is not None:  # found through /proc (Linux)
        assert _positive(phases["total"]) and _positive(phases["claim"])


def test_profile_says_which_process_the_pd_path_costs_cpu_in(quick):
    """Through the proxy every process works; computed locally only the client and the decode
    sim do (a sidecar's idle pollers may tick once)."""
    by_mode = quick[0]["profile"]["cpu_ms_by_mode"]
    assert set(by_mode) == {"proxy", "local", "added"}
    roles = {"client", "prefill sim", "prefill sidecar", "decode sim", "decode sidecar", "proxy"}
    assert roles | {"all"} <= set(by_mode["proxy"])
    assert by_mode["proxy"]["all"] > by_mode["local"]["all"] > 0
    for role in roles:
        assert by_mode["added"][role] == pytest.approx(
            by_mode["proxy"][role] - by_mode["local"][role], abs=1e-3
        )
    assert "CPU ms per request at concurrency 1" in quick[1]


def test_prints_the_tables_and_draws_the_plot(quick):
    _, stdout, png = quick
    assert "P/D+" in stdout and "where one request's time goes" in stdout
    assert "target <= 3 ms" in stdout
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
