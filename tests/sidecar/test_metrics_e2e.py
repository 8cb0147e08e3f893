"""/metrics, /healthz and /readyz on the peer port of real sidecars, after real pulls.

The counters must agree with what the pulls themselves report: bytes by kind equal the pull's
kv_bytes and state_bytes, one finished pull, one READ's descriptor count, one notified release
on the prefill side, and failures counted by reason.
"""

from __future__ import annotations

import secrets

import httpx
import msgspec
import numpy as np
import pytest

from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.tickets import sign_ticket
from kvxferd.wire import HoldRequest, PullRequest
from tests.sidecar.harness import (
    QUIET,
    TOKEN,
    EnginePool,
    ReleasedFeed,
    metric,
    plan,
    split_ids,
    start_sidecars,
    wait_until,
)

pytestmark = pytest.mark.nixl

MODEL = "granite-4.0-h-tiny"  # attention (kv) and Mamba2 state: both byte kinds move


def _get(peer: str, path: str) -> int:
    return httpx.get(f"http://{peer}{path}", timeout=10).status_code


def test_metrics_count_what_a_pull_moved_and_why_a_pull_failed(tmp_path):
    p, d = start_sidecars(str(tmp_path), ["prefill", "decode"], env=QUIET)
    probe = plan(MODEL, num_blocks=4)
    counts = [1 if g.kind == "mamba" else 2 for g in probe.groups]
    num_blocks = 2 * sum(counts) + 1
    pm, dm = plan(MODEL, num_blocks=num_blocks), plan(MODEL, num_blocks=num_blocks)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    try:
        # Probes: alive at once, ready only once an engine registered.
        for s in (p, d):
            assert _get(s.peer, "/healthz") == 200
            assert _get(s.peer, "/readyz") == 503
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            for s in (p, d):
                assert _get(s.peer, "/readyz") == 200

            rng = np.random.default_rng(3)
            pids = split_ids(rng.permutation(np.arange(1, num_blocks)), counts)
            dids = split_ids(rng.permutation(np.arange(1, num_blocks)), counts)
            write_pattern(pm, ppool.views, pids, seed=9)
            ticket = pc.hold(HoldRequest(request_id="m-1", block_ids=pids, num_tokens=500))
            assert metric(p.peer, "kvxferd_holds_active") == 1
            pull = dc.pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=60))
            status = dc.wait_pull(pull.pull_id, timeout_s=90)
            assert status.state == "done", status
            assert verify_pattern(dm, dpool.views, dids, seed=9) is None
            assert status.kv_bytes > 0 and status.state_bytes > 0

            assert metric(d.peer, "kvxferd_transfer_bytes_total", kind="kv") == status.kv_bytes
            assert (
                metric(d.peer, "kvxferd_transfer_bytes_total", kind="state") == status.state_bytes
            )
            assert metric(d.peer, "kvxferd_pulls_total", outcome="done") == 1
            assert metric(d.peer, "kvxferd_pulls_total", outcome="failed") == 0
            assert metric(d.peer, "kvxferd_transfer_descriptors_count") == 1
            assert metric(d.peer, "kvxferd_transfer_descriptors_sum") == status.descriptors
            assert metric(d.peer, "kvxferd_transfer_duration_seconds_count") == 1
            assert metric(d.peer, "kvxferd_pulls_in_flight") == 0

            assert ReleasedFeed(p).wait_for(ticket.hold_id) == {ticket.hold_id: "notified"}
            wait_until(
                lambda: metric(p.peer, "kvxferd_holds_released_total", reason="notified") == 1,
                30,
                "the notified release counted",
            )
            assert metric(p.peer, "kvxferd_holds_active") == 0
            assert metric(p.peer, "kvxferd_holds_created_total") == 1
            assert metric(p.peer, "kvxferd_handshakes_total", outcome="accepted") == 1

            # A failing pull (a hold that never existed) is counted by its reason.
            forged = sign_ticket(
                msgspec.structs.replace(ticket, hold_id=secrets.token_hex(16)), TOKEN.encode()
            )
            pull = dc.pull(PullRequest(tickets=[forged], block_ids=dids, deadline_s=60))
            failed = dc.wait_pull(pull.pull_id, timeout_s=90)
            assert (failed.state, failed.reason) == ("failed", "unknown_hold")
            assert metric(d.peer, "kvxferd_pull_failures_total", reason="unknown_hold") == 1
            assert metric(d.peer, "kvxferd_pulls_total", outcome="failed") == 1
            assert metric(d.peer, "kvxferd_pulls_total", outcome="done") == 1
            assert metric(d.peer, "kvxferd_transfer_bytes_total", kind="kv") == status.kv_bytes
    finally:
        codes = [p.stop(), d.stop()]
        ppool.close()
        dpool.close()
    assert codes == [0, 0]
