"""A decode reads a prefill by the registration its ticket names: when the prefill's engine
registers again in the same sidecar epoch (sleep and wake, a KV-cache re-init), its manifest,
region bases and NIXL memory change, and the decode's cached handshake is of the old one.

Real prefill and decode ``kvxferd serve`` over NIXL/UCX on loopback, POSIX shm pools; every pull
is checked byte for byte.
"""

from __future__ import annotations

import pytest

from kvxferd.pattern import verify_pattern
from tests.sidecar.harness import EnginePool, plan
from tests.sidecar.ranks import DIDS, MODEL, NUM_BLOCKS, Engine, engine_pair

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize(
    ("layout", "outcome"),
    [({}, "done"), ({"num_blocks": 24}, "done"), ({"cross_layer": True}, "done"),
     ({"head_layout": "NHD"}, "incompatible"), ({"kv_packing": "block"}, "incompatible")],
    ids=["same-layout", "more-blocks", "cross-layer", "heads-NHD", "kv-packed-by-block"],
)  # fmt: skip
def test_a_pull_after_the_prefill_registered_again_reads_by_its_new_layout(
    tmp_path, layout, outcome
):
    with engine_pair(str(tmp_path)) as (p, d):
        before = p.hold("before", seed=3)
        assert d.pull([before], timeout_s=30).state == "done"  # the decode has handshaken
        with p.sidecar.client() as c:  # the prefill engine sleeps, then wakes with a new cache
            c.unregister(c.identity().generation)
        manifest = plan(MODEL, **{"num_blocks": NUM_BLOCKS, **layout})
        woken = Engine(p.sidecar, pool=EnginePool(manifest))
        try:
            woken.register()
            ticket = woken.hold("after", seed=4)
            status = d.pull([ticket], timeout_s=30)
            if outcome == "done":
                assert (status.state, status.reason) == ("done", ""), status
                assert verify_pattern(d.manifest, d.pool.views, DIDS, seed=4) is None
                woken.released_once(ticket, "notified")
            else:  # a layout the decode cannot read is refused, never read as the old one
                assert (status.state, status.reason) == ("failed", outcome), status
                woken.abort(ticket)
            # A ticket of the registration before is refused as its claim would be.
            stale = d.pull([before], timeout_s=30)
            assert (stale.state, stale.reason) == ("failed", "unknown_hold"), stale
        finally:
            woken.close()
