"""Child processes that announce readiness with one stdout line (sidecars, sims, the proxy).

A :class:`Child` pumps the child's stdout into a queue from a thread, so waiting for the ready
line has a deadline and the pipe never fills. ``die_with_parent`` asks Linux to SIGKILL the
child when the process that started it dies, so a crashed engine never leaves sidecars behind.
"""

from __future__ import annotations

import collections
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from kvxferd.errors import StartupError

_PR_SET_PDEATHSIG = 1
_KEEP_LINES = 1000
"""Output lines remembered per child (for error messages and tests)."""


def _deathsig_hook() -> object | None:
    """A preexec_fn arming PR_SET_PDEATHSIG, resolved here so the forked child runs no imports."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


class Child:
    """A running child process whose stdout lines are collected by a pump thread."""

    def __init__(self, name: str, proc: subprocess.Popen[str]) -> None:
        self.name = name
        self.proc = proc
        self._lines: queue.Queue[str] = queue.Queue()
        self._seen: collections.deque[str] = collections.deque(maxlen=_KEEP_LINES)
        self._pump = threading.Thread(target=self._run_pump, name=f"pump-{name}", daemon=True)
        self._pump.start()

    @classmethod
    def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        merge_stderr: bool = False,
        die_with_parent: bool = False,
    ) -> Child:
        """Start ``argv``; stderr is merged into the pumped stdout or left to the parent's."""
        hook = _deathsig_hook() if die_with_parent else None
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else None,
            text=True,
            env=dict(env) if env is not None else None,
            preexec_fn=hook,  # type: ignore[arg-type]  # noqa: PLW1509
        )
        return cls(name, proc)

    def _run_pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
            self._seen.append(line)

    @property
    def pid(self) -> int:
        """Process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc.poll() is None

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line starting with ``prefix``; StartupError if the child exits or
        ``timeout_s`` passes first (the child is then killed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, min(left, 0.2)))
            except queue.Empty:
                if not self.alive() and not self._pump.is_alive() and self._lines.empty():
                    self._fail(f"exited with status {self.proc.returncode}")
                if left <= 0:
                    self._fail(f"no ready line within {timeout_s:g}s")
                continue
            if line.startswith(prefix):
                return line.rstrip("\n")

    def _fail(self, why: str) -> None:
        self.kill()
        raise StartupError(f"{self.name} {why}; its output:\n{self.output()}")

    def output(self) -> str:
        """The last lines the child printed (stdout, plus stderr when merged)."""
        return "".join(self._seen)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop several children at once, then :meth:`stop`)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        self._close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (a crash); waits until the process is gone."""
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        self._pump.join(timeout=10)
        if self.proc.stdout is not None and not self._pump.is_alive():
            self.proc.stdout.close()
