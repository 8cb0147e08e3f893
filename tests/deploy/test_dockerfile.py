"""The Dockerfile: multi-stage, non-root, HEALTHCHECK, ``kvxferd serve`` entrypoint; hadolint
clean. (No image is built here: CI has no Docker daemon.)"""

from __future__ import annotations

import json
import re

from tests.deploy.tools import ROOT, require_tool, run_tool

DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_is_clean():
    hadolint = require_tool("hadolint")
    result = run_tool([hadolint, "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_runtime_copies_only_the_venv():
    steps = _instructions()
    froms = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(froms) >= 2
    runtime = steps[froms[-1] :]
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert copies == ["--from=build /opt/venv /opt/venv"]


def test_runtime_runs_as_a_numeric_non_root_user():
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users, "no USER"
    uid = users[-1].split(":")[0]
    assert re.fullmatch(r"\d+", uid) and int(uid) != 0


def test_healthcheck_probes_healthz_and_entrypoint_is_serve():
    steps = {word: rest for word, rest in _instructions()}  # the last of each instruction
    assert "/healthz" in steps["HEALTHCHECK"]
    assert json.loads(steps["ENTRYPOINT"]) == ["kvxferd", "serve"]
    assert "7600" in steps["EXPOSE"]
