"""Child processes: a bounded wait for the ready line, and no orphans when the parent dies."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from kvxferd.errors import StartupError
from kvxferd.sim.children import Child


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_ready_line_is_found_among_other_output():
    child = Child.spawn("talker", _py("print('hello'); print('app ready url=x', flush=True);"
                                      "import time; time.sleep(30)"))  # fmt: skip
    try:
        assert child.wait_line("app ready", timeout_s=20) == "app ready url=x"
        assert child.alive()
    finally:
        assert child.stop() != 0  # SIGTERM ends the sleeping child
    assert "hello" in child.output()


def test_a_child_that_exits_early_fails_with_its_output():
    child = Child.spawn("quitter", _py("import sys; print('boom'); sys.exit(3)"))
    with pytest.raises(StartupError, match=r"quitter exited with status 3(.|\n)*boom"):
        child.wait_line("ready", timeout_s=20)


def test_a_silent_child_times_out_and_is_killed():
    child = Child.spawn("mute", _py("import time; time.sleep(60)"))
    with pytest.raises(StartupError, match="no ready line within 0.5s"):
        child.wait_line("ready", timeout_s=0.5)
    assert not child.alive()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes once it is not running.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(") ")[1].startswith("Z")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_their_parent():
    parent = Child.spawn("parent", _py("""
        import sys, time
        from kvxferd.sim.children import Child
        kid = Child.spawn("kid", [sys.executable, "-c", "import time; time.sleep(60)"],
                          die_with_parent=True)
        print("kid", kid.pid, flush=True)
        time.sleep(60)
    """))  # fmt: skip
    pid = int(parent.wait_line("kid", timeout_s=30).split()[1])
    assert not _gone(pid)
    parent.kill()
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.02)
