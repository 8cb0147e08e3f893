"""Starting sidecars: a sidecar that cannot start fails fast with its own error message."""

from __future__ import annotations

import pytest

from kvxferd.errors import StartupError
from kvxferd.sim.sidecars import serve_argv, start_sidecars


def test_serve_argv_is_what_an_operator_types():
    argv = serve_argv("/tmp/x.sock", "--lease", "5", port=7)
    assert argv[1:] == ["-m", "kvxferd", "serve", "--engine-socket", "/tmp/x.sock",
                        "--peer-port", "7", "--lease", "5"]  # fmt: skip


def test_a_sidecar_that_exits_fails_the_start_with_its_own_error(tmp_path):
    with pytest.raises(StartupError, match=r"bad exited with status 2(.|\n)*--no-such-flag"):
        start_sidecars(str(tmp_path), ["bad"], token="t", per_rank_args=[["--no-such-flag"]],
                       merge_stderr=True, timeout_s=60)  # fmt: skip
