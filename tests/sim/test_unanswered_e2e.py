"""A prefill sim whose minted hold got no answer, and whose abort got none either, keeps the
request's blocks: the sidecar may have placed the hold and a decode may read them. They come
back once the sidecar says (a later abort it answers, or its released feed), never before.

A real ``kvxferd serve``, frozen (SIGSTOP) so its answers cannot come; the sim engine runs in
this process over its own engine client.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest

from kvxferd.sim.engine import EngineSettings, Prompt, SimEngine
from tests.sidecar.harness import QUIET, TOKEN, EnginePool, plan, start_sidecar

pytestmark = pytest.mark.nixl
BOUND_S = 60.0
CALL_S = 2.0  # the sim's bound on one sidecar call: a frozen sidecar answers none


async def _until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for ``predicate``, polling while the engine's tasks run."""
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _prompt(request_id: str) -> Prompt:
    return Prompt(tokens=list(range(40)), max_tokens=1, request_id=request_id,
                  kv_transfer_params={"do_remote_decode": True})  # fmt: skip


def test_a_hold_whose_placement_and_abort_got_no_answer_keeps_its_blocks_until_the_sidecar_says(
    tmp_path,
):
    sidecar = start_sidecar(str(tmp_path), "prefill", env=QUIET)
    pool = EnginePool(plan("llama-3.1-8b", num_blocks=8))
    try:
        with sidecar.client() as c:
            c.register(pool.manifest, pool.specs())
        settings = EngineSettings(role="prefill", engine_id="p", release_poll_s=0.05,
                                  unanswered_retry_s=0.2)  # fmt: skip

        async def scenario() -> SimEngine:
            engine = SimEngine(settings, [pool], [sidecar.async_client(timeout_s=CALL_S)],
                               peer=sidecar.peer, secret=TOKEN.encode())  # fmt: skip
            engine.start()
            try:
                first = await engine.generate(_prompt("held-first"))  # the sim learns to mint
                assert engine.minter.ready
                assert await engine.give_up(first.kv_transfer_params) == 1
                await _until(lambda: not engine._held, "the first request's blocks back")

                os.kill(sidecar.child.pid, signal.SIGSTOP)
                try:
                    await engine.generate(_prompt("unanswered"))  # answered now, held after
                    assert engine.stats.tickets_minted == 1
                    await asyncio.wait_for(asyncio.gather(*engine._placing), BOUND_S)
                    assert engine.stats.holds_failed == 1  # the hold, then its abort, timed out
                    assert "unanswered" in engine._held, "its blocks were freed unconfirmed"
                    assert engine.blocks.free_count < engine.blocks.total
                finally:
                    os.kill(sidecar.child.pid, signal.SIGCONT)
                # The sidecar now answers a retried abort (and reads the late hold call, which
                # it places or refuses): the blocks come back once it has said.
                await _until(lambda: not engine._held, "the unanswered hold's blocks back")
                assert engine.blocks.free_count == engine.blocks.total
                return engine
            finally:
                await engine.close()

        engine = asyncio.run(scenario())
        s = engine.stats
        assert (s.holds_unanswered, engine.unanswered.abandoned, len(engine.unanswered)) == (
            1,
            0,
            0,
        )
        with sidecar.client() as c:  # nothing left held at the sidecar
            assert c.released(0).holds is not None
    finally:
        assert sidecar.stop() == 0
        pool.close()
