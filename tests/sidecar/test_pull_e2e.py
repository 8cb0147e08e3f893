"""A pull moves every byte of the held blocks between two real sidecars (NIXL over loopback).

Each test starts ``kvxferd serve`` processes, gives them engine pools in shared memory, writes
the verification pattern on the prefill side, holds, pulls on the decode side, and checks every
byte of every layer of every pulled block, plus that nothing else on the decode side changed.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from kvxferd.client import AsyncEngineClient
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, PullRequest
from tests.sidecar.harness import (
    EnginePool,
    changed_outside,
    plan,
    split_ids,
    start_sidecar,
    wait_no_handles,
    wait_until,
)

pytestmark = pytest.mark.nixl


@pytest.fixture
def pair(tmp_path):
    """A prefill and a decode sidecar, stopped (SIGTERM) at the end."""
    p = start_sidecar(str(tmp_path), "prefill")
    d = start_sidecar(str(tmp_path), "decode")
    yield p, d
    for s in (p, d):
        assert s.stop() == 0


@pytest.mark.parametrize(
    ("config", "options"),
    [
        ("llama-3.1-8b", {}),
        ("gpt-oss-20b", {}),
        ("granite-4.0-h-tiny", {}),
        ("qwen3-next-80b-a3b", {}),
        ("qwen3.5-397b-a17b", {"attn_pack_size": 4}),
        ("qwen3-8b", {"cross_layer": True}),
    ],
    ids=["dense", "sliding-window", "mamba2-hybrid", "gdn-hybrid", "attn-pack-4", "cross-layer"],
)
def test_pull_moves_every_byte_of_fragmented_blocks_and_nothing_else(pair, config, options):
    p, d = pair
    probe = plan(config, num_blocks=4, **options)
    counts = [1 if g.kind == "mamba" else 3 for g in probe.groups]
    num_blocks = 2 * sum(counts) + 1  # room to fragment; block 0 is the null block
    pm = plan(config, num_blocks=num_blocks, **options)
    dm = plan(config, num_blocks=num_blocks, **options)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            rng = np.random.default_rng(7)
            # Fragmented: shuffled, non-contiguous ids, disjoint across groups (one shared pool).
            pids = split_ids(rng.permutation(np.arange(1, num_blocks)), counts)
            dids = split_ids(rng.permutation(np.arange(1, num_blocks)), counts)
            write_pattern(pm, ppool.views, pids, seed=11)
            ticket = pc.hold(HoldRequest(request_id="req-1", block_ids=pids, num_tokens=100))
            before = dpool.snapshot()
            pull = dc.pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=60))
            status = dc.wait_pull(pull.pull_id, timeout_s=90)
            assert status.state == "done", status
            assert verify_pattern(dm, dpool.views, dids, seed=11) is None
            assert changed_outside(before, dpool.views, dm, dids) == 0
            assert status.kv_bytes + status.state_bytes > 0
            released = wait_until(lambda: pc.released(0).holds, what="hold release")
            assert [(h.hold_id, h.reason) for h in released] == [(ticket.hold_id, "notified")]
    finally:
        ppool.close()
        dpool.close()


def test_one_call_runs_a_pull_and_the_finished_feed_reports_every_outcome(pair):
    p, d = pair
    pm, dm = plan("llama-3.1-8b", num_blocks=9), plan("llama-3.1-8b", num_blocks=9)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    pids, dids = [[3, 1, 7, 5]], [[2, 8, 4, 6]]
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            write_pattern(pm, ppool.views, pids, seed=5)
            good = pc.hold(HoldRequest(request_id="r-good", block_ids=pids, num_tokens=60))
            status = dc.run_pull(PullRequest(tickets=[good], block_ids=dids, request_id="e-1"))
            assert status.state == "done", status
            assert verify_pattern(dm, dpool.views, dids, seed=5) is None
            gone = pc.hold(HoldRequest(request_id="r-gone", block_ids=pids, num_tokens=60))
            pc.abort(gone.hold_id)

            async def run_async():
                async with AsyncEngineClient(d.socket) as ac:
                    req = PullRequest(tickets=[gone], block_ids=dids, request_id="e-2")
                    return await ac.run_pull(req), await ac.finished_pulls(0)

            failed, feed = asyncio.run(run_async())
            assert (failed.state, failed.reason) == ("failed", "unknown_hold"), failed
            assert [(f.request_id, f.state, f.reason, f.failed_block_ids) for f in feed.pulls] == [
                ("e-1", "done", "", []),
                ("e-2", "failed", "unknown_hold", dids),  # every local block is invalid
            ]
            assert (feed.cursor, feed.more) == (2, False)
            first = dc.finished_pulls(0, limit=1)
            assert ([f.request_id for f in first.pulls], first.more) == (["e-1"], True)
            assert dc.finished_pulls(feed.cursor).pulls == []
    finally:
        ppool.close()
        dpool.close()


def test_a_claim_that_gets_no_answer_fails_as_claim_timeout_not_handshake(pair):
    p, d = pair
    pm, dm = plan("llama-3.1-8b", num_blocks=5), plan("llama-3.1-8b", num_blocks=5)
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    ids = [[1, 2, 3, 4]]
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            first = pc.hold(HoldRequest(request_id="r-1", block_ids=ids, num_tokens=60))
            assert dc.run_pull(PullRequest(tickets=[first], block_ids=ids)).state == "done"
            second = pc.hold(HoldRequest(request_id="r-2", block_ids=ids, num_tokens=60))
            before = dpool.snapshot()
            os.kill(p.child.pid, signal.SIGSTOP)  # handshake cached: the claim is what hangs
            try:
                status = dc.run_pull(PullRequest(tickets=[second], block_ids=ids, deadline_s=60))
            finally:
                os.kill(p.child.pid, signal.SIGCONT)
            # The READ went out while the claim was in flight: it may have written the
            # requested blocks, and if the frozen peer kept it in flight past its settle bound,
            # ``unsettled`` wins (the blocks may still change) and names the claim's failure.
            assert status.state == "failed", status
            assert status.reason == "claim_timeout" or (
                status.reason == "unsettled" and "claim_timeout" in status.detail
            ), status
            assert status.kv_bytes == status.state_bytes == 0  # nothing counted as moved
            feed = [f for f in dc.finished_pulls(0).pulls if f.pull_id == status.pull_id]
            assert [(f.state, f.failed_block_ids) for f in feed] == [("failed", ids)]
            wait_no_handles(p, d)  # a quarantined READ ends once the peer runs again
            assert changed_outside(before, dpool.views, dm, ids) == 0
    finally:
        ppool.close()
        dpool.close()
