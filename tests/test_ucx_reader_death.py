"""scripts/ucx_reader_death.py kills readers mid-READ, then checks its target with one more READ.

Run here over UCX's default loopback transports (CMA: native READs, no queued GET replies), where
the target survives: the script's JSON, its exit code, its byte check and its cleanup of the
SIGKILLed readers' shared memory are what is tested. Over TCP the target may crash in UCX
(docs/reliability.md); that is what the script is for, and not a CI test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ucx_reader_death.py"


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvx-death-")}


def test_killed_readers_leave_a_target_that_still_serves_every_byte():
    before = _segments()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "all", "UCX_NET_DEVICES": "lo"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--kills", "2", "--readers", "1", "--mib", "8"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (report, out.stderr[-2000:])
    assert report["readers_killed"] == 2
    assert (report["target_died"], report["target_exit"], report["verified"]) == (False, 0, True)
    assert _segments() <= before  # the killed readers' segments were unlinked


def test_bad_arguments_exit_2_with_one_line():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--kills", "0"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 2
    assert "--kills, --readers and --mib must be at least 1" in out.stderr
