"""Starting sidecars: a sidecar that cannot start fails fast with its own error message;
attached sidecars: bounded wait, and unhealthy once their socket is gone or replaced."""

from __future__ import annotations

import os

import pytest

from kvxferd.api.sockets import bind_unix
from kvxferd.errors import StartupError
from kvxferd.sim.sidecars import AttachedSidecar, attach_sidecars, serve_argv, start_sidecars


def test_serve_argv_is_what_an_operator_types():
    argv = serve_argv("/tmp/x.sock", "--lease", "5", port=7)
    assert argv[1:] == ["-m", "kvxferd", "serve", "--engine-socket", "/tmp/x.sock",
                        "--peer-port", "7", "--lease", "5"]  # fmt: skip


def test_a_sidecar_that_exits_fails_the_start_with_its_own_error(tmp_path):
    with pytest.raises(StartupError, match=r"bad exited with status 2(.|\n)*--no-such-flag"):
        start_sidecars(str(tmp_path), ["bad"], token="t", per_rank_args=[["--no-such-flag"]],
                       merge_stderr=True, timeout_s=60)  # fmt: skip


def test_an_attached_sidecar_is_unhealthy_once_its_socket_is_gone_or_replaced(tmp_path):
    path = str(tmp_path / "s.sock")
    first = bind_unix(path)
    st = os.stat(path)
    sidecar = AttachedSidecar(path, identity=(st.st_dev, st.st_ino, st.st_ctime_ns))
    assert sidecar.problem() == ""
    second = bind_unix(path + ".new")  # a restarted sidecar's socket: another file
    os.replace(path + ".new", path)
    try:
        assert sidecar.problem() == f"sidecar at {path} restarted; this engine must register again"
    finally:
        first.close()
        second.close()
    os.unlink(path)
    assert sidecar.problem() == f"sidecar socket {path} is gone"


def test_attaching_waits_only_as_long_as_its_bound(tmp_path):
    with pytest.raises(StartupError, match=r"absent\.sock: no sidecar answered /healthz"):
        attach_sidecars([str(tmp_path / "absent.sock")], timeout_s=0.0)
