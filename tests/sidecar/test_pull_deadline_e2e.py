"""Every pull ends by its deadline, whatever its prefill sidecar does: one with no engine
registered answers at once (FAILED ``handshake``), one that has stopped answering ends FAILED
``deadline``. Real ``kvxferd serve`` processes over NIXL loopback; nothing is written."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvxferd.sidecar.reads import SETTLE_S
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import Identity, PullRequest, Ticket
from tests.sidecar.harness import (
    TOKEN,
    EnginePool,
    changed_outside,
    plan,
    start_sidecars,
)

pytestmark = pytest.mark.nixl

DEADLINE_S = 3.0
MARGIN_S = 20.0  # generous: a pull that never ends is what fails, not a slow machine


def _ticket(ident: Identity) -> Ticket:
    """A validly signed ticket naming ``ident``'s sidecar (a hold it does not have)."""
    ticket = Ticket(
        engine_id=ident.engine_id, epoch=ident.epoch, hold_id=os.urandom(16).hex(),
        request_id="r", block_ids=[[1, 2]], num_tokens=20, expires_at=time.time() + 30,
        tp_rank=0, tp_size=1, peer=ident.peer_address, generation=0,
    )  # fmt: skip
    return sign_ticket(ticket, TOKEN.encode())


@pytest.mark.parametrize("prefill", ["no_engine", "stopped"])
def test_a_pull_ends_failed_by_its_deadline(tmp_path, prefill):
    p_side, d_side = start_sidecars(str(tmp_path), ["p", "d"])
    stopped, pool = False, None
    try:
        manifest = plan("llama-3.1-8b", num_blocks=9)
        pool = EnginePool(manifest)
        with d_side.client() as c:
            c.register(manifest, pool.specs())
        with p_side.client() as c:
            ident = c.identity()
        assert ident.generation == -1  # the prefill sidecar has no engine
        if prefill == "stopped":
            os.kill(p_side.child.pid, signal.SIGSTOP)
            stopped = True
        before = pool.snapshot()
        with d_side.client() as c:
            req = PullRequest(tickets=[_ticket(ident)], block_ids=[[3, 4]], request_id="r",
                              deadline_s=DEADLINE_S)  # fmt: skip
            pull_id = c.pull(req).pull_id
            status = c.wait_pull(pull_id, DEADLINE_S + SETTLE_S + MARGIN_S)
            finished = c.finished_pulls(0)
        assert status.state == "failed", status
        assert status.reason == ("handshake" if prefill == "no_engine" else "deadline"), status
        assert [(f.pull_id, f.state) for f in finished.pulls] == [(pull_id, "failed")]
        assert finished.pulls[0].failed_block_ids == [[3, 4]]
        assert changed_outside(before, pool.snapshot(), manifest, [[]]) == 0
    finally:
        if stopped:
            os.kill(p_side.child.pid, signal.SIGCONT)
        p_side.stop()
        d_side.stop()
        if pool is not None:
            pool.close()  # unlinks its shared memory
