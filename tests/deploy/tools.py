"""External tools the deploy checks run (promtool, kubectl, hadolint, yamllint).

A missing tool skips its test on a developer machine and fails it when ``KVXFERD_REQUIRE_TOOLS=1``
(set by ``.ci/run``; ``make test`` fetches promtool first), so CI never passes by skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# `make test` extracts promtool here; pip-installed tools sit next to the interpreter.
SEARCH = (ROOT / ".tools" / "bin", Path(sys.executable).parent)


def require_tool(name: str) -> str:
    """Path of ``name``; skips the test when missing, or fails it if tools are required."""
    for folder in SEARCH:
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} not found in .tools/bin, the venv or PATH (`make test` fetches it)"
    if os.environ.get("KVXFERD_REQUIRE_TOOLS") == "1":
        pytest.fail(message + "; KVXFERD_REQUIRE_TOOLS=1 forbids skipping")
    pytest.skip(message)


def run_tool(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool (bounded); the result carries stdout and stderr for assertion messages."""
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=120)
