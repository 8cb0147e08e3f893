"""Per-registration rank plans: computed once, recomputed for a new registration. Prepared
lists: made in the background (a pull never waits for them), bounded by a row budget, released
on close."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import msgspec

from kvxferd import descriptors
from kvxferd.sidecar.peerviews import PeerViews, RankPlans
from tests.descriptors.layouts import hybrid_spec, render


def _replicated():
    # 2 KV heads over prefill TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1; no mamba.
    base = hybrid_spec()
    return replace(base, attn=replace(base.attn, total_heads=2), mamba=None, mamba_groups=())


def test_decode_rank_0_reads_one_replica_of_each_head_and_releases_the_others():
    plans = RankPlans()
    plan = plans.get(render(_replicated(), 1, 0), 4)
    assert plan.sources == (0, 2)
    assert plan.unread == (1, 3)


def test_other_decode_ranks_release_nothing():
    # Decode rank 1 of 2 holds head 1 (prefill ranks 2, 3) and reads the replica 1 % 2 = 3.
    plan = RankPlans().get(render(_replicated(), 2, 1), 4)
    assert plan.sources == (3,)
    assert plan.unread == ()


def test_a_plan_is_kept_per_registration_and_prefill_tp():
    plans = RankPlans()
    local = render(hybrid_spec(), 1, 0)
    first = plans.get(local, 2)
    assert plans.get(local, 2) is first
    assert plans.get(local, 1) is not first
    again = msgspec.structs.replace(local)  # a re-registration: a new manifest object
    assert plans.get(again, 2) is not first
    assert plans.get(again, 2) == first


# -- prepared lists (PeerViews): pure bookkeeping over a recording transport --------------------


class _List:
    def __init__(self, mem: str = "DRAM", device_id: int = 0) -> None:
        self.released = False
        self.memory = (mem, device_id)

    def release(self) -> None:
        self.released = True


class _Transport:
    """Records what was prepared; the lists only know whether they were released."""

    def __init__(self) -> None:
        self.lists: list[_List] = []

    def prep_local(self, table, *, mem="DRAM", device_id=0):  # noqa: ANN001
        self.lists.append(_List(mem, device_id))
        return self.lists[-1]

    def prep_remote(self, agent, table, *, mem="DRAM", device_id=0):  # noqa: ANN001
        return self.prep_local(table, mem=mem, device_id=device_id)

    def read(self, remote, local, remote_descs, notif=b"", **memory):  # noqa: ANN001
        return memory


def _peer(i: int, m):  # noqa: ANN001
    bases = [0x10000000 * (k + 1) for k in range(len(m.regions))]
    return SimpleNamespace(address=f"p{i}", engine_id=f"e{i}", epoch=1, generation=-1,
                           agent_name=f"a{i}", region_bases=bases, manifest=m)  # fmt: skip


async def _plan_until_prepped(views: PeerViews, peer, m, ids) -> None:  # noqa: ANN001
    bases = [0x20000000 * (k + 1) for k in range(len(m.regions))]
    geo = descriptors.read_geometry(m, m)
    first = views.plan(peer, m, bases, geo, ids, ids)
    assert first.tables is not None  # the first pull from a peer never waits for its lists
    async with asyncio.timeout(30):
        while views.plan(peer, m, bases, geo, ids, ids).prepped is None:
            await asyncio.sleep(0.01)


def _fragmented(m):  # noqa: ANN001
    return [[1] if g.kind == "mamba" else [1, 3, 5] for g in m.groups]


def test_lists_are_prepared_in_the_background_and_bounded_by_the_row_budget():
    m = render(hybrid_spec(), 1, 0)
    rows = descriptors.prepped_geometry(descriptors.read_geometry(m, m)).num_rows

    async def run() -> None:
        t = _Transport()
        views = PeerViews(t, enabled=True, budget_rows=rows * 2)  # room for two peer pairs
        for i in range(3):
            await _plan_until_prepped(views, _peer(i, m), m, _fragmented(m))
        assert len(t.lists) == 6
        assert [x.released for x in t.lists] == [True, True] + [False] * 4  # oldest pair gone
        views.close()
        assert all(x.released for x in t.lists)
        await _plan_until_prepped(views, _peer(0, m), m, _fragmented(m))  # usable again
        assert [x.released for x in t.lists[6:]] == [False, False]
        views.close()

    asyncio.run(run())


def test_disabled_views_prepare_nothing():
    m = render(hybrid_spec(), 1, 0)

    async def run() -> None:
        t = _Transport()
        views = PeerViews(t, enabled=False)
        geo = descriptors.read_geometry(m, m)
        for _ in range(3):
            assert views.plan(_peer(0, m), m, [0] * len(m.regions), geo, *[_fragmented(m)] * 2
                              ).tables is not None  # fmt: skip
        views.close()
        assert t.lists == []

    asyncio.run(run())


def _in_vram(m, device_id: int):  # noqa: ANN001
    regions = [msgspec.structs.replace(r, mem="VRAM", device_id=device_id) for r in m.regions]
    return msgspec.structs.replace(m, regions=regions)


def test_reads_and_lists_carry_each_sides_memory_type_and_device():
    """vLLM's KV lives in VRAM: NIXL finds no registration covering VRAM posted as DRAM, so
    every READ and prepared list names the memory of its side's regions (ours, the peer's)."""
    host = render(hybrid_spec(), 1, 0)
    ours, theirs = _in_vram(host, 1), _in_vram(host, 3)

    async def run() -> None:
        t = _Transport()
        views = PeerViews(t, enabled=True)
        peer = _peer(0, theirs)
        geo = descriptors.read_geometry(ours, theirs)
        bases = [0] * len(ours.regions)
        read = views.plan(peer, ours, bases, geo, *[_fragmented(ours)] * 2)
        assert read.tables is not None
        assert read.post(t, "a0", b"")() == {
            "mem": "VRAM",
            "device_id": 1,
            "remote_mem": "VRAM",
            "remote_device_id": 3,
        }
        await _plan_until_prepped(views, peer, ours, _fragmented(ours))
        assert [x.memory for x in t.lists] == [("VRAM", 1), ("VRAM", 3)]  # local, remote
        views.close()
        # A host peer's tables say DRAM on its side.
        mixed = views.plan(_peer(1, host), ours, bases, descriptors.read_geometry(ours, host),
                           *[_fragmented(ours)] * 2)  # fmt: skip
        assert mixed.post(t, "a1", b"")() == {
            "mem": "VRAM",
            "device_id": 1,
            "remote_mem": "DRAM",
            "remote_device_id": 0,
        }
        views.close()

    asyncio.run(run())
