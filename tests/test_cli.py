"""The ``kvxferd`` command as an operator runs it (a subprocess): help texts, one-line errors with
exit status 2, and ``layout --json`` figures for a hybrid model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvxferd.config import env_help


def kvxferd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    return subprocess.run(
        [sys.executable, "-m", "kvxferd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "UCX_NET_DEVICES": "lo", **(env or {})},
    )


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxferd: error: "), proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_help_lists_the_commands():
    proc = kvxferd("--help")
    assert proc.returncode == 0
    assert "layout" in proc.stdout and "serve" in proc.stdout


def test_serve_help_lists_every_environment_variable():
    proc = kvxferd("serve", "--help")
    assert proc.returncode == 0
    for name, _ in env_help():
        assert name in proc.stdout, name
    assert "--engine-socket" in proc.stdout and "--peer-token-file" in proc.stdout


def test_serve_without_a_token_refuses_in_one_line(tmp_path):
    line = _one_error_line(kvxferd("serve", "--engine-socket", str(tmp_path / "s.sock")))
    assert "KVXFERD_PEER_TOKEN" in line
    assert not (tmp_path / "s.sock").exists()


def test_serve_with_a_bad_environment_value_names_the_variable(tmp_path):
    env = {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_PEER_PORT": "eighty"}
    line = _one_error_line(kvxferd("serve", "--engine-socket", str(tmp_path / "s"), env=env))
    assert "KVXFERD_PEER_PORT" in line


def test_serve_with_a_missing_token_file_names_the_flag(tmp_path):
    proc = kvxferd("serve", "--peer-token-file", str(tmp_path / "absent"))
    assert "--peer-token-file" in _one_error_line(proc)


@pytest.fixture(scope="module")
def granite():
    proc = kvxferd("layout", "--config", "granite-4.0-h-tiny", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_layout_json_has_the_hybrid_page_figures_of_granite(granite):
    assert {k: granite[k] for k in ("block_size", "kernel_block_size", "page_size_bytes",
                                    "conv_state_bytes", "ssm_state_bytes", "num_groups",
                                    "group_size")} == {
        "block_size": 400, "kernel_block_size": 400, "page_size_bytes": 819200,
        "conv_state_bytes": 19968, "ssm_state_bytes": 786432, "num_groups": 10,
        "group_size": 4,
    }  # fmt: skip
    # Padding is what the page holds beyond one mamba layer's conv + SSM state.
    assert granite["mamba_padding_bytes"] == 819200 - 19968 - 786432


def test_layout_json_groups_are_nine_mamba_and_one_attention_group_of_four_layers(granite):
    kinds = [g["kind"] for g in granite["groups"]]
    assert kinds.count("mamba") == 9 and kinds.count("full_attention") == 1
    assert {g["num_layers"] for g in granite["groups"]} == {4}
    assert sum(g["num_layers"] for g in granite["groups"]) == 40


def test_layout_with_an_unknown_config_fails_in_one_line():
    line = _one_error_line(kvxferd("layout", "--config", "no-such-model"))
    assert "no-such-model" in line


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_layout_with_a_request_of_no_tokens_fails_in_one_line(tokens):
    line = _one_error_line(kvxferd("layout", "--config", "llama-3.1-8b", "--tokens", tokens))
    assert f"--tokens: must be >= 1, got {tokens}" in line


_NO_SERVER_IMPORT = """
import sys
from kvxferd.cli import main
status = main(sys.argv[1:])
heavy = sorted(m for m in ("kvxferd.api.server", "nixl", "torch") if m in sys.modules)
print("imported:", ",".join(heavy))
raise SystemExit(status)
"""


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        ([], {}, "KVXFERD_PEER_TOKEN"),
        (["--log-level", "loud"], {"KVXFERD_PEER_TOKEN": "t"}, "log_level"),
        (["--log-level", "warn"], {"KVXFERD_PEER_TOKEN": "t"}, "log_level"),  # not uvicorn's
        (["--engine-socket", "/no/such/dir/s.sock"], {"KVXFERD_PEER_TOKEN": "t"}, "/no/such/dir"),
        (["--engine-socket", "/tmp/" + "s" * 120], {"KVXFERD_PEER_TOKEN": "t"}, "AF_UNIX"),
        (["--peer-port", "70000"], {"KVXFERD_PEER_TOKEN": "t"}, "peer_port"),
        (
            ["--engine-socket", "/tmp/" + "s" * 100],
            {"KVXFERD_PEER_TOKEN": "t"},
            "engine_frames_socket",
        ),  # fmt: skip
        ([], {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_EVENT_LOOP": "tokio"}, "event_loop"),
    ],
    ids=[
        "no-token",
        "log-level",
        "log-level-python-only",
        "socket-dir",
        "socket-length",
        "port",
        "frames-length",
        "event-loop",
    ],  # fmt: skip
)
def test_serve_argument_errors_exit_before_the_server_is_imported(tmp_path, args, env, named):
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    argv = ["serve", "--engine-socket", str(tmp_path / "s.sock"), *args]
    proc = subprocess.run(
        [sys.executable, "-c", _NO_SERVER_IMPORT, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **env},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("kvxferd: error: ") and named in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "imported:"  # no NIXL, no torch, no server module
