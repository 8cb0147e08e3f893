"""scripts/vllm_pd_check.py as a user runs it: a config it has never seen, --json, every byte
verified end to end through vLLM's scheduler, the connector, sidecars and NIXL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.nixl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_an_unseen_gdn_hybrid_config_moves_byte_exact(tmp_path):
    with open(os.path.join(ROOT, "tests/vllm/configs/qwen3-next/config.json")) as f:
        hf = json.load(f)
    # Shapes no test uses elsewhere: other head counts, head sizes and layer pattern.
    hf.update(num_hidden_layers=6, full_attention_interval=3, num_key_value_heads=1,
              head_dim=128, linear_num_key_heads=2, linear_num_value_heads=6,
              linear_key_head_dim=64, linear_value_head_dim=48)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/vllm_pd_check.py"), "--config",
         str(tmp_path), "--requests", "2", "--num-blocks", "32", "--json"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True
    assert (report["requests_ok"], report["requests_failed"]) == (2, 0)
    assert report["kv_bytes"] > 0 and report["state_bytes"] > 0
    assert report["model"] == "Qwen3NextForCausalLM"
    assert report["groups"].count("MambaSpec") >= 1 and "FullAttentionSpec" in report["groups"]


@pytest.mark.parametrize(
    "config,p_tp,d_tp", [("dense", 2, 1), ("dense", 1, 2), ("nemotron-h", 1, 2)]
)
def test_heterogeneous_tp_moves_byte_exact(config, p_tp, d_tp):
    """Dense and a Mamba2 hybrid (its conv state read by section and row) change TP size."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/vllm_pd_check.py"), "--config",
         os.path.join(ROOT, "tests/vllm/configs", config), "--prefill-tp", str(p_tp),
         "--decode-tp", str(d_tp), "--requests", "2", "--num-blocks", "16", "--json"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True and report["failures"] == []
    assert (report["requests_ok"], report["requests_failed"]) == (2, 0)
    assert report["kv_bytes"] > 0 and (report["state_bytes"] > 0) == (config != "dense")


def test_a_hybrid_prefill_whose_ranks_share_a_pod_sidecar_moves_byte_exact():
    """--prefill-pod: the prefill's TP 2 workers share one pod sidecar; one ticket a request,
    its Mamba states and attention blocks read from both ranks."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/vllm_pd_check.py"), "--config",
         os.path.join(ROOT, "tests/vllm/configs/nemotron-h"), "--prefill-tp", "2",
         "--prefill-pod", "--requests", "2", "--num-blocks", "16", "--json"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True and report["failures"] == []
    assert (report["requests_ok"], report["requests_failed"]) == (2, 0)
    assert report["kv_bytes"] > 0 and report["state_bytes"] > 0


def test_a_pull_that_ends_inside_the_step_that_started_it_is_counted():
    """vLLM reports a step's finished pulls in that step's output: the check must not drop the
    answer of the step that started the pull (a warm pull can end before that step returns)."""
    from kvxferd.vllm import pdcheck
    from kvxferd.vllm.scheduler import StepOrders

    class Quiet:  # a rank whose later steps report nothing
        def step(self, meta):
            return None, None

    deadline = time.monotonic() + 0.5  # bounds the wait if the first answer were dropped
    started = [(None, {"d-1"}), (None, {"d-1"})]
    assert pdcheck._wait_all([Quiet(), Quiet()], 1, StepOrders, deadline, started) == {"d-1"}
    assert pdcheck._wait_all([Quiet(), Quiet()], 1, StepOrders, deadline, [(None, {"d-1"})] * 1
                             + [(None, None)]) is None  # fmt: skip
