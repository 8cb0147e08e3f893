"""SIGTERM ends ``kvxferd serve`` within its shutdown grace even while an engine call cannot end:
a pull-status long poll (over frames, as the vLLM worker sends it) on a pull waiting for a peer
that is frozen (SIGSTOP) is cut once ``--shutdown-grace`` has passed, and the sidecar exits 0.
Real ``kvxferd serve`` processes; the long poll is seen in flight by the frame payload it holds
(``kvxferd_request_body_bytes{api="engine"}``), not by timing."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from kvxferd.client import EngineClient, SidecarUnreachableError
from kvxferd.wire import PullRequest
from tests.sidecar.harness import EnginePool, metric, plan, start_sidecars, wait_until
from tests.sidecar.test_pull_deadline_e2e import _ticket

pytestmark = pytest.mark.nixl

GRACE_S = 1.0  # --shutdown-grace: far below the long poll and the handshake's bound
EXIT_BOUND_S = GRACE_S + 8.0  # generous (the teardown takes < 1 s), short of the old 10 s grace
BOUND_S = 30.0
FROZEN = {"KVXFERD_HANDSHAKE_TIMEOUT_S": "600"}  # the pull waits on the frozen peer for good


def test_sigterm_ends_a_sidecar_whose_long_poll_waits_on_a_frozen_peer_within_its_grace(
    tmp_path,
):
    p_side, d_side = start_sidecars(str(tmp_path), ["p", "d"], "--shutdown-grace", str(GRACE_S),
                                    env=FROZEN)  # fmt: skip
    manifest = plan("llama-3.1-8b", num_blocks=9)
    pool = EnginePool(manifest)
    with p_side.client() as c:
        ticket = _ticket(c.identity())  # of a hold it does not have: never read anyway
    os.kill(p_side.child.pid, signal.SIGSTOP)
    failed: list[BaseException] = []

    def long_poll(pull_id: str) -> None:
        with EngineClient(d_side.socket, frames=True, timeout_s=BOUND_S) as c:
            try:
                c.wait_pull(pull_id, 600.0)
            except SidecarUnreachableError as exc:  # cut by the shutdown
                failed.append(exc)

    try:
        with d_side.client() as c:
            c.register(manifest, pool.specs())
            req = PullRequest(tickets=[ticket], block_ids=[[3, 4]], request_id="r",
                              deadline_s=300.0)  # fmt: skip
            pull_id = c.pull(req).pull_id
        polling = threading.Thread(target=long_poll, args=(pull_id,), daemon=True)
        polling.start()
        in_flight = lambda: metric(d_side.peer, "kvxferd_request_body_bytes", api="engine")  # noqa: E731
        wait_until(lambda: in_flight() > 0, BOUND_S, "the long poll in flight")
        d_side.child.proc.send_signal(signal.SIGTERM)
        try:
            status = d_side.child.proc.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"kvxferd serve still runs {EXIT_BOUND_S:g} s after SIGTERM with a "
                        f"{GRACE_S:g} s grace; its output:\n{d_side.child.output()}")  # fmt: skip
        assert status == 0
        polling.join(BOUND_S)
        assert not polling.is_alive() and len(failed) == 1
    finally:
        os.kill(p_side.child.pid, signal.SIGCONT)
        d_side.kill()  # (gone already when it passed)
        p_side.stop()
        pool.close()
