"""Pulls by index into a peer's prepared lists, and by coalesced tables, between real sidecars.

A fragmented request (no two blocks adjacent on both sides) is posted by index into the
descriptor lists prepared once per peer epoch, on a background thread after the first pull from
that peer (which goes by tables meanwhile); a contiguous one, whose runs coalesce into fewer
descriptors, as coalesced tables. Both move every byte and nothing else. Without
``--prepped-reads`` (the default) everything goes as tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, PullRequest
from tests.sidecar.harness import (
    EnginePool,
    changed_outside,
    metric,
    plan,
    split_ids,
    start_sidecar,
    wait_no_handles,
    wait_until,
)

pytestmark = pytest.mark.nixl


def _pull(pc, dc, pm, dm, ppool, dpool, pids, dids, seed):
    write_pattern(pm, ppool.views, pids, seed=seed)
    ticket = pc.hold(HoldRequest(request_id=f"r{seed}", block_ids=pids, num_tokens=100))
    before = dpool.snapshot()
    pull = dc.pull(PullRequest(tickets=[ticket], block_ids=dids, deadline_s=60))
    status = dc.wait_pull(pull.pull_id, timeout_s=90)
    assert status.state == "done", status
    assert verify_pattern(dm, dpool.views, dids, seed=seed) is None
    assert changed_outside(before, dpool.views, dm, dids) == 0
    return status


def test_fragmented_pulls_go_by_index_and_contiguous_ones_by_coalesced_tables(tmp_path):
    p = start_sidecar(str(tmp_path), "prefill")
    d = start_sidecar(str(tmp_path), "decode", "--prepped-reads")
    pm = plan("qwen3-next-80b-a3b", num_blocks=41)
    dm = plan("qwen3-next-80b-a3b", num_blocks=41)
    counts = [1 if g.kind == "mamba" else 4 for g in pm.groups]
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            # Fragmented: every other block, so no two are adjacent on either side.
            spaced = split_ids(np.arange(1, 41, 2), counts)
            # The first pull from a peer starts preparing its lists and goes by tables.
            _pull(pc, dc, pm, dm, ppool, dpool, spaced, spaced, seed=2)
            assert metric(d.peer, "kvxferd_reads_total", path="tables") == 1
            wait_until(lambda: metric(d.peer, "kvxferd_prepped_lists") == 2, what="lists")
            _pull(pc, dc, pm, dm, ppool, dpool, spaced, spaced, seed=3)
            assert metric(d.peer, "kvxferd_reads_total", path="prepped") == 1
            assert metric(d.peer, "kvxferd_prepped_lists") == 2  # one local, one remote
            # Contiguous runs: coalescing merges them, so tables win.
            runs = split_ids(np.arange(1, 41), counts)
            status = _pull(pc, dc, pm, dm, ppool, dpool, runs, runs, seed=4)
            assert metric(d.peer, "kvxferd_reads_total", path="tables") == 2
            # Again fragmented, the prepared lists are reused (no new ones).
            _pull(pc, dc, pm, dm, ppool, dpool, spaced, spaced, seed=5)
            assert metric(d.peer, "kvxferd_reads_total", path="prepped") == 2
            assert metric(d.peer, "kvxferd_prepped_lists") == 2
            assert status.descriptors < sum(counts) * 12  # merged below one per block and region
            wait_no_handles(p, d)
    finally:
        for s in (p, d):
            assert s.stop() == 0
        ppool.close()
        dpool.close()


def test_by_default_every_read_goes_as_tables(tmp_path):
    p = start_sidecar(str(tmp_path), "prefill")
    d = start_sidecar(str(tmp_path), "decode")
    pm = plan("qwen3-next-80b-a3b", num_blocks=41)
    dm = plan("qwen3-next-80b-a3b", num_blocks=41)
    counts = [1 if g.kind == "mamba" else 4 for g in pm.groups]
    ppool, dpool = EnginePool(pm), EnginePool(dm)
    try:
        with p.client() as pc, d.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
            spaced = split_ids(np.arange(1, 41, 2), counts)
            for seed in (6, 7):
                _pull(pc, dc, pm, dm, ppool, dpool, spaced, spaced, seed=seed)
            assert metric(d.peer, "kvxferd_reads_total", path="tables") == 2
            assert metric(d.peer, "kvxferd_reads_total", path="prepped") == 0
            assert metric(d.peer, "kvxferd_prepped_lists") == 0
            wait_no_handles(p, d)
    finally:
        for s in (p, d):
            assert s.stop() == 0
        ppool.close()
        dpool.close()
