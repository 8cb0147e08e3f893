"""``kvxferd demo`` across block sizes: a hybrid whose prefill (TP 4) and decode (TP 1) blocks
differ (re-blocking), every pull byte-verified and every answer equal to the colocated one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest

pytestmark = pytest.mark.nixl

CONFIG = "falcon-h1-0.5b"


def test_demo_prefill_tp4_to_decode_tp1_with_other_block_sizes_verifies() -> None:
    hf = load_hf_config(CONFIG)
    sizes = [plan_manifest(hf, PlanOptions(tp_size=tp)).groups[0].block_size for tp in (4, 1)]
    assert sizes[0] != sizes[1]  # 400 vs 800 tokens per block
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "demo", "--config", CONFIG, "--prefill-tp", "4",
         "--decode-tp", "1", "--requests", "6", "--concurrency", "2", "--json"],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["verified"] is True
    assert summary["requests_ok"] == 6 and summary["mismatches"] == 0
    assert summary["pulls_ok"] >= 1 and summary["pulls_failed"] == 0
    assert summary["verified_failed"] == 0 and summary["recomputed"] == 0
    assert summary["kv_bytes"] > 0 and summary["state_bytes"] > 0
