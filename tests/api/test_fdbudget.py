"""The sidecar's open-file budget: its connection caps, accept bursts and a reserve must fit
``ulimit -n``; it raises its soft limit when the hard one allows, and otherwise refuses to start
with one line, instead of letting a peer-port flood starve the engine socket."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from kvxferd.api.fdbudget import ACCEPT_BURSTS, FD_RESERVE, ensure_fd_budget, fds_needed
from kvxferd.api.limits import EdgeLimits
from kvxferd.errors import ConfigError


def _limits(cap: int, backlog: int = 64) -> EdgeLimits:
    return EdgeLimits(max_connections=cap, max_header_bytes=16384, max_body_bytes=1 << 20,
                      header_timeout_s=10.0, body_timeout_s=30.0, backlog=backlog)  # fmt: skip


def test_the_budget_counts_caps_accept_bursts_and_the_reserve():
    need = fds_needed([_limits(1024), _limits(256)])
    assert need == FD_RESERVE + 1024 + 256 + 2 * ACCEPT_BURSTS * 64


def _in_child(soft: int, hard: int, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose open-file limit is (soft, hard)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    env = {**os.environ, "KVXFERD_PEER_TOKEN": "x" * 32}
    return subprocess.run([sys.executable, "-c", code], preexec_fn=limit, capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip


def test_the_soft_limit_is_raised_when_the_hard_one_allows():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fds_needed([_limits(1024), _limits(256)])
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard open-file limit {hard} is below {need}")
    code = (
        "import resource\n"
        "from kvxferd.api.fdbudget import ensure_fd_budget\n"
        "from tests.api.test_fdbudget import _limits\n"
        "print(ensure_fd_budget([_limits(1024), _limits(256)]),"
        " resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = _in_child(512, hard, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(need), str(need)]


def test_a_hard_limit_too_low_is_a_config_error_naming_the_settings():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= fds_needed([_limits(1 << 20)]):
        pytest.skip("the open-file limit is too high to fail")
    with pytest.raises(ConfigError, match="ulimit -n") as refused:
        ensure_fd_budget([_limits(1 << 20)])  # far past any hard limit we could be given
    for setting in ("KVXFERD_ENGINE_MAX_CONNECTIONS", "KVXFERD_PEER_MAX_CONNECTIONS"):
        assert setting in str(refused.value)  # the names an operator can set (no such flags)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)  # left as it was


def test_kvxferd_serve_refuses_to_start_with_one_line_when_the_caps_do_not_fit(tmp_path):
    code = (
        "import sys\nfrom kvxferd.cli import main\n"
        f"sys.exit(main(['serve', '--engine-socket', {str(tmp_path / 'e.sock')!r},"
        " '--peer-port', '0']))\n"
    )
    done = _in_child(512, 512, code)
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "ulimit -n" in lines[0], done.stderr
    assert not (tmp_path / "e.sock").exists()  # nothing bound before the check
