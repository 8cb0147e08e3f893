"""scripts/bench_jsonbody.py runs end to end and reports sane numbers (not a speed test): a row
per body and reader, and the hostile body refused by the proxy with next to nothing allocated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_jsonbody.py"


def test_every_body_is_read_and_the_hostile_one_refused(tmp_path):
    out = tmp_path / "jsonbody.json"
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mib", "1", "--repeat", "1",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {(r["body"], r["reader"]): r for r in json.loads(out.read_text())["rows"]}
    assert {body for body, _ in rows} == {"many-keys", "colon-prompt", "chat", "normal"}
    assert all(r["ms"] >= 0 and r["peak_mb"] >= 0 for r in rows.values())
    hostile = rows[("many-keys", "proxy parse")]
    assert hostile["outcome"] == "TooManyKeysError" and hostile["peak_mb"] < 1
    assert rows[("colon-prompt", "proxy parse")]["outcome"] == "3 keys"
    assert rows[("many-keys", "sim parse")]["outcome"] == "InvalidRequestError"
