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


def test_serve_help_states_the_exit_status_of_a_shutdown_stuck_on_the_store():
    from kvxferd.sidecar.offload import EXIT_STORE_STUCK

    proc = kvxferd("serve", "--help")
    text = " ".join(proc.stdout.split())
    assert f"; {EXIT_STORE_STUCK} when shutdown left store I/O blocked" in text


def test_serve_help_shows_the_default_of_each_setting_flag():
    proc = kvxferd("serve", "--help")
    text = " ".join(proc.stdout.split())  # argparse wraps help lines
    for flag, default in (("--engine-socket PATH", "/tmp/kvxferd.sock"),
                          ("--peer-port N", "0"), ("--lease S", "30.0"),
                          ("--max-claim S", "120.0"), ("--max-holds N", "65536"),
                          ("--store-dram-bytes N", "1073741824"),
                          ("--log-level LEVEL", "info")):  # fmt: skip
        shown = text.split(flag, 2)[2]  # past the usage line, at the flag's own help
        assert shown.split(" --", 1)[0].endswith(f"(default: {default})"), flag


def test_every_serve_flag_named_after_a_setting_reaches_the_config(monkeypatch):
    """A flag parsed and never handed on is ignored in silence (``--read-stripes`` was)."""
    from dataclasses import fields

    from kvxferd.cli import _parser
    from kvxferd.commands import serve
    from kvxferd.config import Config

    handed: dict = {}
    monkeypatch.setattr(serve, "load_config", lambda given: handed.update(given) or Config())
    serve._load(_parser().parse_args(["serve"]))
    settings = {f.name for f in fields(Config)}
    sub = next(a for a in _parser()._subparsers._group_actions if "serve" in a.choices)  # noqa: SLF001
    dests = {a.dest for a in sub.choices["serve"]._actions} & settings  # noqa: SLF001
    assert dests - set(handed) == set()


def test_serve_without_a_token_refuses_in_one_line(tmp_path):
    line = _one_error_line(kvxferd("serve", "--engine-socket", str(tmp_path / "s.sock")))
    assert "KVXFERD_PEER_TOKEN" in line
    assert not (tmp_path / "s.sock").exists()


def test_serve_with_a_bad_environment_value_names_the_variable(tmp_path):
    env = {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_PEER_PORT": "eighty"}
    line = _one_error_line(kvxferd("serve", "--engine-socket", str(tmp_path / "s"), env=env))
    assert "KVXFERD_PEER_PORT" in line


def test_serve_with_a_body_budget_below_the_largest_frame_refuses_in_one_line(tmp_path):
    env = {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "1000"}
    line = _one_error_line(kvxferd("serve", "--engine-socket", str(tmp_path / "s"), env=env))
    assert "max_body_bytes_in_flight: 1000" in line
    assert "max_body_bytes + max_header_bytes" in line


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


@pytest.mark.parametrize("tokens", ["0", "-5", str(10**12)])
def test_layout_with_a_request_of_no_tokens_or_past_any_context_fails_in_one_line(tokens):
    line = _one_error_line(kvxferd("layout", "--config", "llama-3.1-8b", "--tokens", tokens))
    assert f"--tokens: must be 1 to 16777216, got {tokens}" in line


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [("--tp", "0", "--tp: must be >= 1, got 0"),
     ("--num-speculative-tokens", "-1", "--num-speculative-tokens: must be 0 to 1024, got -1"),
     ("--num-speculative-tokens", str(10**17), "--num-speculative-tokens: must be 0 to 1024")],
)  # fmt: skip
def test_layout_with_a_size_out_of_range_fails_in_one_line(flag, value, line):
    assert line in _one_error_line(kvxferd("layout", "--config", "granite-4.0-h-tiny", flag, value))


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
        (
            [
                "--engine-socket",
                "/tmp/kvx-same.sock",
                "--engine-frames-socket",
                "/tmp/kvx-same.sock",
            ],
            {"KVXFERD_PEER_TOKEN": "t"},
            "engine_frames_socket: /tmp/kvx-same.sock is the engine socket",
        ),  # fmt: skip
        ([], {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_EVENT_LOOP": "tokio"}, "event_loop"),
        (["--engine-id", "rank\n0"], {"KVXFERD_PEER_TOKEN": "t"}, "engine_id"),
        (
            [],
            {"KVXFERD_PEER_TOKEN": "t", "KVXFERD_MAX_BODY_BYTES_IN_FLIGHT": "1000"},
            "max_body_bytes_in_flight: 1000 is less than max_body_bytes + max_header_bytes",
        ),  # fmt: skip
    ],
    ids=[
        "no-token",
        "log-level",
        "log-level-python-only",
        "socket-dir",
        "socket-length",
        "port",
        "frames-length",
        "frames-same-path",
        "event-loop",
        "engine-id",
        "body-budget",
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


_NO_SIM_START = """
import sys
import kvxferd.sim.server as server
def started(opts):
    print("started")
    return 0
server.run_sim = started
from kvxferd.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvxferd sim --role decode`` with ``args``, stopped where it would start (prints
    ``started``)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVXFERD_")}
    argv = ["sim", "--role", "decode", "--config", "llama-3.1-8b", *args]
    return subprocess.run([sys.executable, "-c", _NO_SIM_START, *argv], capture_output=True,
                          text=True, timeout=120, env=base)  # fmt: skip


def test_sim_with_sane_numbers_gets_to_start():
    proc = _sim("--pull-timeout", "5", "--sidecar-timeout", "9", "--lease", "3", "--port", "0",
                "--unanswered-retry", "2", "--unanswered-bound", "2")  # fmt: skip
    assert (proc.returncode, proc.stdout.strip()) == (0, "started"), proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [("--pull-timeout", "nan", "--pull-timeout: must be > 0 and finite, got nan"),
     ("--pull-timeout", "inf", "--pull-timeout: must be > 0 and finite, got inf"),
     ("--pull-timeout", "0", "--pull-timeout: must be > 0 and finite, got 0.0"),
     ("--sidecar-timeout", "-1", "--sidecar-timeout: must be > 0 and finite, got -1.0"),
     ("--sidecar-timeout", "nan", "--sidecar-timeout: must be > 0 and finite, got nan"),
     ("--lease", "nan", "--lease: must be > 0 and finite, got nan"),
     ("--port", "70000", "--port: 70000 is not a TCP port"),
     ("--pool-blocks", "0", "--pool-blocks: must be >= 2, got 0"),
     ("--store-chunk-tokens", "0", "--store-chunk-tokens: must be >= 1, got 0"),
     ("--unanswered-retry", "nan", "--unanswered-retry: must be > 0 and finite, got nan"),
     ("--unanswered-retry", "0", "--unanswered-retry: must be > 0 and finite, got 0.0"),
     ("--unanswered-bound", "inf", "--unanswered-bound: must be > 0 and finite, got inf"),
     ("--unanswered-bound", "-5", "--unanswered-bound: must be > 0 and finite, got -5.0"),
     ("--unanswered-retry", "700",
      "--unanswered-retry: must be at most --unanswered-bound (600 s), got 700")],
)  # fmt: skip
def test_sim_number_flags_out_of_range_fail_in_one_line_before_anything_starts(flag, value, line):
    assert line in _one_error_line(_sim(flag, value))


def test_a_second_sidecar_on_a_running_ones_socket_is_refused_and_the_first_keeps_serving(
    tmp_path,
):
    """Before, the second replaced the first's socket file: the engine would then register its
    memory with both, and a stopping sidecar unlinked the other's socket."""
    from kvxferd.sim.sidecars import start_sidecars

    (first,) = start_sidecars(str(tmp_path), ["a"], token="t")
    sock = tmp_path / "a.sock"
    try:
        inode = os.stat(sock).st_ino
        proc = kvxferd("serve", "--engine-socket", str(sock), "--peer-port", "0",
                       env={"KVXFERD_PEER_TOKEN": "t"})  # fmt: skip
        line = _one_error_line(proc)
        assert line.endswith(
            f"engine_socket: {sock} is in use by a running sidecar (pid {first.child.proc.pid})"
        )
        assert os.stat(sock).st_ino == inode
        with first.client() as client:
            assert client.identity().epoch == first.epoch
    finally:
        assert first.stop() == 0
    (after,) = start_sidecars(str(tmp_path), ["a"], token="t")  # the lock went with its process
    after.stop()
    assert after.epoch != first.epoch
