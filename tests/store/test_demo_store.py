"""``kvxferd demo --store DIR`` twice: every process of the second run is new (sims, sidecars,
proxy) and its prefill runs at another TP size (2, then 1), yet it loads every prompt from the
store's files and verifies every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl


def _demo(store_dir: str, prefill_tp: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvxferd", "demo", "--requests", "6", "--concurrency", "2",
         "--prefill-tp", str(prefill_tp), "--store", store_dir, "--json"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "UCX_NET_DEVICES": "lo"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_second_run_hits_the_store_across_a_full_restart_and_a_tp_change(tmp_path):
    store_dir = str(tmp_path / "store")
    first = _demo(store_dir, prefill_tp=2)
    assert first["verified"] is True
    assert first["prompt_tokens"] > 0
    assert first["store_hit_tokens"] < first["prompt_tokens"]  # the first sight of each prompt
    assert any(name.endswith(".kvx") for _d, _s, files in os.walk(store_dir) for name in files)
    second = _demo(store_dir, prefill_tp=1)
    assert second["verified"] is True and second["requests_ok"] == 6
    assert (first["prefill_tp"], second["prefill_tp"]) == (2, 1)
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["store_hit_tokens"] == second["prompt_tokens"]  # every prompt, in full
    assert second["verified_failed"] == 0 and second["mismatches"] == 0
