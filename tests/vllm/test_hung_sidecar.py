"""A worker beside a hung sidecar (SIGSTOP: it still accepts connections, so each call waits
for the client's timeout): after one call got no answer, the worker sends none for a while
(ten times as long as that call took, at least a second), so engine steps do not each wait
out every call's timeout; a hold ordered meanwhile was never placed and is freed at once."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from kvxferd.client import EngineClient, frames_available
from kvxferd.vllm import quiet as quiet_module
from kvxferd.vllm.scheduler import StepOrders
from tests.sidecar.harness import start_sidecars
from tests.vllm.ranks import Rank, finish, prefill_side

pytestmark = pytest.mark.nixl


def test_a_hung_sidecar_is_not_called_again_until_its_silence_has_been_waited_out(
    engines, tmp_path, monkeypatch
):
    engine = engines("dense", "LBHNC", num_blocks=24)
    (side,) = start_sidecars(str(tmp_path), ["p"])
    rank = None
    try:
        rank = Rank(engine, "LBHNC", side)
        with side.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], engine.config.cache_config.block_size)
        finish(sched, "r1", ([1, 2],), 200)
        assert rank.step(sched.take_orders()) == (None, None)  # held: its feed is read each step
        worker = rank.connector._worker
        # A short timeout for the test's sake (30 s in an engine), on a clock the test moves.
        short = EngineClient(side.socket, timeout_s=0.5, frames=frames_available(side.socket))
        kept, worker.client.client = worker.client.client, short
        released: list[int] = []
        real = short.released
        short.released = lambda cursor, *a, **kw: released.append(cursor) or real(cursor, *a, **kw)
        clock = SimpleNamespace(now=100.0)
        monkeypatch.setattr(quiet_module, "time", SimpleNamespace(monotonic=lambda: clock.now))

        os.kill(side.child.pid, signal.SIGSTOP)
        try:
            assert rank.step(StepOrders()) == (None, None)  # the feed's call gets no answer
            assert len(released) == 1
            finish(sched, "r2", ([3, 4],), 200)
            sending, _ = rank.step(sched.take_orders())
            assert sending == {"r2"}  # refused before it was sent: no hold, freed at once
            assert len(released) == 1  # and the feed was not asked
        finally:
            os.kill(side.child.pid, signal.SIGCONT)
        clock.now += quiet_module.QUIET_S
        assert rank.step(StepOrders()) == (None, None)
        assert len(released) == 2  # asked again once the quiet time is over
        worker.client.client = kept
        short.close()
    finally:
        if rank is not None:
            rank.close()
        side.stop()
