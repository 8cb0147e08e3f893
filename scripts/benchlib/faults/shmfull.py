"""``/dev/shm`` full (the campaign's private tmpfs): pulls on the running pair must still end by
their deadline, a sim started now must fail with a clear error (not a signal, not a hang) and
leave nothing behind."""

from __future__ import annotations

import subprocess
import sys

from kvxferd.sim.children import Child

from . import kinds, shm
from . import pulls as P
from .context import Ctx

LEAVE_BYTES = 64 << 10
SIM_BOUND_S = 90.0


def shm_full(ctx: Ctx, kind: str, config: str, env: dict[str, str]) -> None:
    before = shm.entries()
    filled = shm.fill(LEAVE_BYTES)
    ctx.tally.note(kind, f"filled_{filled >> 20}MiB")
    try:
        _rec, run = kinds._normal_pull(ctx, kind, ctx.rng.randint(16, kinds.MAX_BLOCKS), 5.0)
        if run is not None:
            ctx.tally.note(kind, "pull:" + P.judge(ctx.pair, ctx.tally, kind, run))
        _sim_while_full(ctx, kind, config, env)
    finally:
        shm.unfill()
    left = shm.entries() - before - ctx.pair.pool_names
    if left:
        ctx.tally.violate(
            kind, "leftover_shm", f"{sorted(left)[:3]} left by a failed start", len(left)
        )


def _sim_while_full(ctx: Ctx, kind: str, config: str, env: dict[str, str]) -> None:
    argv = [sys.executable, "-m", "kvxferd", "sim", "--role", "prefill", "--config", config,
            "--pool-blocks", "64", "--port", "0", "--log-level", "warning"]  # fmt: skip
    child = Child.spawn("sim while /dev/shm is full", argv, env=env, merge_stderr=True,
                        die_with_parent=True)  # fmt: skip
    try:
        child.proc.wait(timeout=SIM_BOUND_S)
    except subprocess.TimeoutExpired:
        ready = "kvxferd sim ready" in child.output()
        if not ready:
            ctx.tally.violate(kind, "hangs", f"sim neither ready nor exited in {SIM_BOUND_S:g}s")
        ctx.tally.note(kind, "sim:started" if ready else "sim:hung")
        child.stop(20.0)
        return
    code = child.proc.returncode
    child.kill()
    if code < 0:
        ctx.tally.violate(kind, "crashes", f"sim died of signal {-code} with /dev/shm full")
    ctx.tally.note(kind, f"sim:exit{code}")
