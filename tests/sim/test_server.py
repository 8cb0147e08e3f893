"""Startup housekeeping of ``kvxferd sim``: socket dirs of killed sims are swept."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from kvxferd.sim.server import _sweep_stale_dirs


def test_dirs_of_dead_sims_are_swept_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tempfile.mkdtemp(prefix=f"kvxferd-sim-{dead.pid}-")
    kept = tempfile.mkdtemp(prefix=f"kvxferd-sim-{os.getpid()}-")
    open(os.path.join(gone, "x.sock"), "w").close()
    try:
        _sweep_stale_dirs()
        assert not os.path.exists(gone)
        assert os.path.isdir(kept)
    finally:
        os.rmdir(kept)


def test_a_pull_timeout_past_the_sidecars_default_bound_raises_their_bound(monkeypatch):
    # The sim's pulls carry deadline_s = --pull-timeout; a sidecar refuses one past its
    # --max-pull-deadline (422), so the sim must start its sidecars allowing it.
    from kvxferd.cli import _parser
    from kvxferd.commands.serve import _load
    from kvxferd.sim.server import SimOptions, sidecar_args

    monkeypatch.setenv("KVXFERD_PEER_TOKEN", "t" * 32)
    for timeout in (30.0, 700.0):
        opts = SimOptions(role="decode", config="llama-3.1-8b", pull_timeout_s=timeout)
        args = _parser().parse_args(["serve", *sidecar_args(opts)])
        assert _load(args).max_pull_deadline_s >= timeout


def test_the_unanswered_hold_flags_set_the_engines_retry_interval_and_bound():
    from kvxferd.cli import _parser
    from kvxferd.commands.sim import options
    from kvxferd.sim.engine import EngineSettings
    from kvxferd.sim.server import engine_settings

    argv = ["sim", "--role", "prefill", "--config", "llama-3.1-8b"]
    given = engine_settings(options(_parser().parse_args(
        [*argv, "--unanswered-retry", "0.25", "--unanswered-bound", "30"])), "e")  # fmt: skip
    assert (given.unanswered_retry_s, given.unanswered_bound_s) == (0.25, 30.0)
    default = engine_settings(options(_parser().parse_args(argv)), "e")
    engine = EngineSettings(role="prefill", engine_id="e")
    assert (default.unanswered_retry_s, default.unanswered_bound_s) == (
        engine.unanswered_retry_s, engine.unanswered_bound_s)  # fmt: skip
