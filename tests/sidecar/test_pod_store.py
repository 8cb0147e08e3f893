"""The store on a pod sidecar (``serve --pod-ranks N --store-dir``): each rank's worker saves,
looks up and loads ITS rank's blocks through the one sidecar, naming its ``tp_rank``. The ranks
share one hold (the same block ids); a save from rank r copies rank r's blocks under entries of
rank r (``t<N>r<r>``), once rank r placed it; rank 1 owns other KV heads than rank 0, so rank
0's entries are never loaded into rank 1 (it finds nothing until it saved its own). A store call
on a pod that names no rank of it, and one on a rank's own sidecar that names another rank, is a 422
naming ``tp_rank``, and nothing is written.

An in-process pod Sidecar over POSIX shm (self-test READ over NIXL loopback), driven on one
loop; then the same calls over a real ``kvxferd serve`` process's engine socket.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvxferd.client import SidecarError
from kvxferd.errors import StoreError
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.sidecar.service import Sidecar
from kvxferd.store import chunk_keys
from kvxferd.store.canonical import fill_tokens
from kvxferd.store.tiers import parse_filename
from kvxferd.wire import (
    HoldRequest,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookupRequest,
    StoreSaveRequest,
)
from tests.sidecar.harness import EnginePool, plan, start_sidecar
from tests.sidecar.pods import (
    NUM_TOKENS,
    PIDS,
    PodPools,
    hold_on_all,
    hold_ranks,
    hold_request,
    pod_process,
    run_pod,
)

pytestmark = pytest.mark.nixl

SEED, CHUNK = 5, 16
DST = [[6, 0, 4, 2]]
"""The blocks a load writes on each rank (none of PIDS)."""
KEYS = chunk_keys(list(range(NUM_TOKENS)), CHUNK)


def _ranks_stored(store_dir: Path) -> dict[int, set[str]]:
    """The keys each writer rank has entries of in the store's file tier (every entry is
    ``t2``: written at the pod's TP size)."""
    out: dict[int, set[str]] = {}
    for path in store_dir.rglob("*.kvx"):
        eid = parse_filename(path.name)
        assert eid is not None and eid.tp_size == 2, path.name
        out.setdefault(eid.tp_rank, set()).add(eid.key)
    return out


def _poison(pools: PodPools, rank: int) -> list[np.ndarray]:
    """Make DST of ``rank`` hold what a load must overwrite (the pattern everywhere but the
    rows of its NUM_TOKENS tokens, which are 0xA5): the image its memory must have after a
    load, every byte of every region (DST holding the pattern, all else as now)."""
    manifest, views = pools.manifests[rank], pools.pools[rank].views
    write_pattern(manifest, views, DST, SEED)
    want = [v.copy() for v in views]
    fill_tokens(manifest, views, 0, np.asarray(DST[0]), 0, NUM_TOKENS, 0xA5)
    assert verify_pattern(manifest, views, DST, SEED) is not None  # the load has work to do
    return want


def _images(pools: PodPools) -> list[list[np.ndarray]]:
    return [[v.copy() for v in pool.views] for pool in pools.pools]


def _same(views: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(v, w) for v, w in zip(views, want, strict=True))


def test_each_rank_saves_and_loads_its_own_blocks_of_one_pod_hold(tmp_path):
    store_dir = tmp_path / "store"

    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen, offload = sidecar.generation, sidecar.offload
        hold_id = hold_on_all(sidecar, pools, seed=SEED).hold_id  # PIDS of every rank
        # each rank's blocks hold its own bytes: a load of the other rank's would show
        assert not np.array_equal(pools.pools[0].views[0], pools.pools[1].views[0])

        def save(rank: int):  # noqa: ANN202
            return offload.save(StoreSaveRequest(request_id="r1", keys=KEYS, hold_id=hold_id,
                                                 generation=gen, tp_rank=rank))  # fmt: skip

        def load(rank: int):  # noqa: ANN202
            return offload.load(StoreLoadRequest(keys=KEYS, block_ids=DST, num_tokens=NUM_TOKENS,
                                                 generation=gen, tp_rank=rank))  # fmt: skip

        saved = await save(0)
        assert saved.chunks_saved == len(KEYS) and saved.kv_bytes > 0
        assert _ranks_stored(store_dir) == {0: set(KEYS)}

        # rank 0's entries are not rank 1's: rank 1 finds nothing and loads nothing
        before = _images(pools)
        miss = await offload.lookup(StoreLookupRequest(keys=KEYS, num_tokens=NUM_TOKENS,
                                                       tp_rank=1))  # fmt: skip
        assert miss.matched == 0
        missed = await load(1)
        assert (missed.state, missed.reason) == ("failed", "store_miss")
        assert all(_same(p.views, b) for p, b in zip(pools.pools, before, strict=True))

        assert (await save(1)).chunks_saved == len(KEYS)  # rank 1's own, beside rank 0's
        assert _ranks_stored(store_dir) == {0: set(KEYS), 1: set(KEYS)}
        assert (await save(0)).chunks_present == len(KEYS)  # rank 0's again: all there

        for rank in (1, 0):
            hit = await offload.lookup(StoreLookupRequest(keys=KEYS, num_tokens=NUM_TOKENS,
                                                          tp_rank=rank))  # fmt: skip
            assert hit.matched == NUM_TOKENS
            want = _poison(pools, rank)
            other = _images(pools)[1 - rank]
            done = await load(rank)
            assert (done.state, done.tokens) == ("done", NUM_TOKENS)
            manifest, views = pools.manifests[rank], pools.pools[rank].views
            assert verify_pattern(manifest, views, DST, SEED) is None  # its own bytes
            assert _same(views, want)  # every other byte of the rank's memory as it was
            assert _same(pools.pools[1 - rank].views, other)  # the other rank's untouched

    run_pod(scenario, ranks=2, engine_id="pod-store", registered=True,
            store_dir=str(store_dir), store_chunk_tokens=CHUNK)  # fmt: skip


def test_a_store_call_on_a_pod_without_one_of_its_ranks_is_a_422_naming_tp_rank(tmp_path):
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen, offload = sidecar.generation, sidecar.offload
        hold_id = hold_on_all(sidecar, pools, seed=SEED).hold_id
        before = _images(pools)
        for rank in (-1, 2):  # absent, or not a rank of this pod of 2
            calls = (
                offload.save(StoreSaveRequest(request_id="r1", keys=KEYS, hold_id=hold_id,
                                              tp_rank=rank)),
                offload.lookup(StoreLookupRequest(keys=KEYS, num_tokens=NUM_TOKENS,
                                                  tp_rank=rank)),
                offload.load(StoreLoadRequest(keys=KEYS, block_ids=DST, num_tokens=NUM_TOKENS,
                                              generation=gen, tp_rank=rank)),
            )  # fmt: skip
            for call in calls:
                with pytest.raises(StoreError) as err:
                    await call
                assert (err.value.status, err.value.field) == (422, "tp_rank")
        assert not list((tmp_path / "store").rglob("*.kvx"))  # nothing saved
        assert all(_same(p.views, b) for p, b in zip(pools.pools, before, strict=True))

    run_pod(scenario, ranks=2, engine_id="pod-store-rank", registered=True,
            store_dir=str(tmp_path / "store"), store_chunk_tokens=CHUNK)  # fmt: skip


def test_over_the_engine_socket_each_rank_names_itself_and_loads_its_own_bytes(tmp_path):
    """``kvxferd serve --pod-ranks 2 --store-dir``: every rank's calls from its own client."""
    flags = ("--store-dir", str(tmp_path / "store"), "--store-chunk-tokens", str(CHUNK))
    with pod_process(str(tmp_path), 2, *flags) as (sidecar, pools):
        with sidecar.client() as c:
            generation = c.identity().generation
        ticket = hold_ranks(sidecar, pools, generation, seed=SEED)
        for rank in range(2):
            with sidecar.client() as c:
                saved = c.store_save(
                    StoreSaveRequest(
                        request_id="r1", keys=KEYS, hold_id=ticket.hold_id, tp_rank=rank
                    )
                )
                assert saved.chunks_saved == len(KEYS)
        for rank in range(2):
            want = _poison(pools, rank)
            with sidecar.client() as c:
                with pytest.raises(StoreError) as err:  # the worker forgot its rank
                    c.store_load(StoreLoadRequest(keys=KEYS, block_ids=DST,
                                                  num_tokens=NUM_TOKENS))  # fmt: skip
                assert (err.value.status, err.value.field) == (422, "tp_rank")
                with pytest.raises(SidecarError) as bad:  # no rank at all: refused as it comes
                    c.store_load(StoreLoadRequest(keys=KEYS, block_ids=DST,
                                                  num_tokens=NUM_TOKENS, tp_rank=-2))  # fmt: skip
                assert (bad.value.status, bad.value.body.error, bad.value.body.field) == (
                    422, "ValidationError", "tp_rank")  # fmt: skip
                done: StoreLoadStatus = c.store_load(StoreLoadRequest(
                    keys=KEYS, block_ids=DST, num_tokens=NUM_TOKENS, tp_rank=rank))  # fmt: skip
            assert done.state == "done"
            assert verify_pattern(pools.manifests[rank], pools.pools[rank].views, DST,
                                  SEED) is None  # fmt: skip
            assert _same(pools.pools[rank].views, want)


def test_a_rank_sidecar_refuses_a_store_call_naming_another_rank(tmp_path):
    """A rank's own sidecar serves that rank: -1 or its rank, else a 422 naming ``tp_rank``."""
    manifest = plan("llama-3.1-8b", num_blocks=8, tp_size=2, tp_rank=1)
    pool = EnginePool(manifest)
    sidecar = start_sidecar(str(tmp_path), "rank1", "--store-dir", str(tmp_path / "store"),
                            "--store-chunk-tokens", str(CHUNK))  # fmt: skip
    try:
        with sidecar.client() as c:
            c.register(manifest, pool.specs())
            write_pattern(manifest, pool.views, PIDS, SEED)
            ticket = c.hold(HoldRequest(request_id="r1", block_ids=PIDS, num_tokens=NUM_TOKENS))
            with pytest.raises(StoreError) as err:
                c.store_save(StoreSaveRequest(request_id="r1", keys=KEYS,
                                              hold_id=ticket.hold_id, tp_rank=0))  # fmt: skip
            assert (err.value.status, err.value.field) == (422, "tp_rank")
            assert not list((tmp_path / "store").rglob("*.kvx"))
            for rank in (-1, 1):  # absent, or its own
                c.store_save(StoreSaveRequest(request_id="r1", keys=KEYS,
                                              hold_id=ticket.hold_id, tp_rank=rank))  # fmt: skip
                hit = c.store_lookup(StoreLookupRequest(keys=KEYS, num_tokens=NUM_TOKENS,
                                                        tp_rank=rank))  # fmt: skip
                assert hit.matched == NUM_TOKENS
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_rank_saves_by_a_pod_hold_only_once_it_placed_that_hold(tmp_path):
    """The pod's hold pins a rank's blocks only from that rank's placement on: before it, rank
    r's engine may still be writing them (or have let them go), so a save by ``hold_id`` from a
    rank that has not placed the hold is a 422 naming ``hold_id``, and nothing is written; once
    it placed it, the same save stores that rank's bytes."""
    store_dir = tmp_path / "store"

    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        gen, offload = sidecar.generation, sidecar.offload
        pools.fill(PIDS, SEED)
        ticket = sidecar.hold(hold_request(0, gen))  # rank 0 only: rank 1's blocks not pinned

        def save(rank: int):  # noqa: ANN202
            return offload.save(StoreSaveRequest(request_id="r1", keys=KEYS,
                                                 hold_id=ticket.hold_id, generation=gen,
                                                 tp_rank=rank))  # fmt: skip

        with pytest.raises(StoreError) as err:
            await save(1)
        assert (err.value.status, err.value.field) == (422, "hold_id")
        assert "rank 1" in str(err.value) and "placed by ranks [0]" in str(err.value)
        assert not list(store_dir.rglob("*.kvx"))  # nothing saved under rank 1's entries
        assert ticket.hold_id in sidecar.holds  # the hold itself is left as it was

        assert (await save(0)).chunks_saved == len(KEYS)  # rank 0 placed it: its blocks
        assert sidecar.hold(hold_request(1, gen)) == ticket
        assert (await save(1)).chunks_saved == len(KEYS)
        assert _ranks_stored(store_dir) == {0: set(KEYS), 1: set(KEYS)}

    run_pod(scenario, ranks=2, engine_id="pod-store-unplaced", registered=True,
            store_dir=str(store_dir), store_chunk_tokens=CHUNK)  # fmt: skip
