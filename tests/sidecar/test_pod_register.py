"""A pod sidecar's registration (``--pod-ranks N``): every rank of the engine registers on the
one engine socket into a slot of its own; the answers wait for the whole pod and carry its one
generation; a taken rank, another TP size or a manifest that differs from the others' is refused
naming the field; a rank whose pod does not complete in time is refused and its memory let go;
the handshake names every rank's layout; an unregister from any rank ends the whole pod.

An in-process pod Sidecar over POSIX shm (self-test READ over NIXL loopback), driven on one loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from msgspec import structs

from kvxferd.client import SidecarUnreachableError
from kvxferd.errors import (
    ManifestError,
    MemoryInUseError,
    NotRegisteredError,
    PodConflictError,
    RegisterInProgressError,
    StaleGenerationError,
)
from kvxferd.pattern import verify_pattern
from kvxferd.sidecar.service import Sidecar
from kvxferd.wire import ClaimRequest, PullRequest, UnregisterRequest
from tests.sidecar.harness import QUIET, plan, start_sidecar
from tests.sidecar.pods import MODEL, PIDS, PodPools, hold_on_all, register_all, run_pod, until

pytestmark = pytest.mark.nixl


def test_every_rank_registers_into_its_slot_and_all_answers_carry_one_generation():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        first = asyncio.create_task(sidecar.register(pools.request(2)))
        await until(lambda: sidecar.pod.slots.missing == [0, 1, 3], "rank 2 in its slot")
        assert not first.done()  # it waits for the others
        assert not sidecar.ready and sidecar.identity().generation == -1  # no pod yet
        rest = await register_all_but(sidecar, pools, 2)
        answers = [await asyncio.wait_for(first, 30), *rest]
        assert len({a.generation for a in answers}) == 1
        assert answers[0].generation == sidecar.generation and sidecar.ready
        ident = sidecar.identity()
        assert (ident.pod_ranks, ident.tp_rank, ident.tp_size) == (4, 0, 4)
        assert sidecar.manifest.tp_rank == 0  # rank 0's manifest on top
        assert len(sidecar._regions) == sum(len(m.regions) for m in pools.manifests)
        with pytest.raises(PodConflictError) as again:  # a complete pod: every rank is taken
            await sidecar.register(pools.request(1, instance="another-engine"))
        assert again.value.field == "manifest.tp_rank"
        same = await asyncio.wait_for(sidecar.register(pools.request(1)), 30)  # a repeat
        assert same.generation == answers[0].generation

    run_pod(scenario, ranks=4, engine_id="pod-register")


async def register_all_but(sidecar: Sidecar, pools: PodPools, rank: int) -> list:
    async with asyncio.timeout(60):
        return list(await asyncio.gather(
            *(sidecar.register(pools.request(r)) for r in range(pools.ranks) if r != rank)
        ))  # fmt: skip


def test_a_taken_rank_another_tp_size_or_a_differing_manifest_is_refused_naming_the_field():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        first = asyncio.create_task(sidecar.register(pools.request(0)))
        await until(lambda: sidecar.pod.slots.missing == [1], "rank 0 in its slot")
        with pytest.raises(PodConflictError) as taken:  # another engine's rank 0
            await sidecar.register(pools.request(0, instance="another-engine"))
        assert taken.value.field == "manifest.tp_rank" and taken.value.status == 409
        with pytest.raises(PodConflictError) as memory:  # rank 0 with other memory
            await sidecar.register(
                structs.replace(pools.request(0), regions=pools.pools[1].specs())
            )
        assert memory.value.field == "manifest.tp_rank"
        other_size = plan(MODEL, tp_size=4, tp_rank=1, num_blocks=pools.manifests[1].num_blocks)
        with pytest.raises(ManifestError) as size:
            await sidecar.register(pools.request(1, other_size))
        assert size.value.field == "manifest.tp_size"
        differs = structs.replace(pools.manifests[1], model="another-model")
        with pytest.raises(PodConflictError) as model:
            await sidecar.register(pools.request(1, differs))
        assert model.value.field == "manifest.model"
        assert sidecar.pod.slots.missing == [1] and not first.done()  # refused: nothing kept
        # Each rank's own segment names (and the engine id it sent) may differ: accepted.
        own = structs.replace(pools.manifests[1], engine_id="another-process")
        second = await asyncio.wait_for(sidecar.register(pools.request(1, own)), 30)
        assert (await asyncio.wait_for(first, 30)).generation == second.generation

    run_pod(scenario, ranks=2, engine_id="pod-conflicts")


def test_a_rank_whose_pod_does_not_complete_in_time_is_refused_and_its_memory_let_go():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        registered, deregistered = spy_registrations(sidecar)
        with pytest.raises(NotRegisteredError, match=r"ranks \[1\] did not register within"):
            await asyncio.wait_for(sidecar.register(pools.request(0)), 30)
        assert sidecar.pod.slots.missing == [0, 1] and not sidecar.ready
        assert registered and sorted(map(id, deregistered)) == sorted(map(id, registered))
        assert sidecar._regions == []  # nothing of rank 0 is kept
        # The pod forms afresh once both come (each within the timeout of the other).
        answers = await register_all(sidecar, pools)
        assert answers[0].generation == answers[1].generation == sidecar.generation

    run_pod(scenario, ranks=2, engine_id="pod-timeout", pod_register_timeout_s=0.5)


def test_a_register_cancelled_while_it_waits_for_the_pod_lets_its_slot_and_memory_go():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        registered, deregistered = spy_registrations(sidecar)
        waiting = asyncio.create_task(sidecar.register(pools.request(1)))
        await until(lambda: sidecar.pod.slots.missing == [0], "rank 1 in its slot")
        waiting.cancel()  # its worker went away (a server that cancels the call)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert sidecar.pod.slots.missing == [0, 1]
        assert registered and sorted(map(id, deregistered)) == sorted(map(id, registered))
        answers = await register_all(sidecar, pools)  # rank 1 may come again
        assert answers[0].generation == answers[1].generation

    run_pod(scenario, ranks=2, engine_id="pod-cancelled")


def test_a_repeated_register_waits_with_the_first_and_the_slot_goes_with_the_last_call():
    """A worker whose register got no answer registers the same memory again: the sidecar's
    first call may still wait (a server that does not cancel it); the slot and its memory stay
    while either call waits, and go when both gave up."""

    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        registered, deregistered = spy_registrations(sidecar)
        slots = sidecar.pod.slots

        async def first_and_repeat() -> tuple[asyncio.Task, asyncio.Task]:
            dropped = len(deregistered)
            first = asyncio.create_task(sidecar.register(pools.request(0)))
            await until(lambda: slots.missing == [1], "rank 0 in its slot")
            again = asyncio.create_task(sidecar.register(pools.request(0)))
            await until(lambda: slots.slot(0).calls == 2, "the repeat waiting with it")
            first.cancel()  # the first call's client gave up
            with pytest.raises(asyncio.CancelledError):
                await first
            assert slots.missing == [1] and len(deregistered) == dropped  # the repeat waits
            return first, again

        _, again = await first_and_repeat()
        again.cancel()  # the last call of the slot gave up: it goes, with its memory
        with pytest.raises(asyncio.CancelledError):
            await again
        assert slots.missing == [0, 1]
        assert registered and sorted(map(id, deregistered)) == sorted(map(id, registered))

        _, again = await first_and_repeat()
        other = await asyncio.wait_for(sidecar.register(pools.request(1)), 30)
        assert (await asyncio.wait_for(again, 30)).generation == other.generation

    run_pod(scenario, ranks=2, engine_id="pod-repeat")


def test_a_repeated_register_while_the_pod_unregisters_is_refused_as_in_progress():
    """The pod's registration is being let go (an unregister waits for a decode's claim to
    end): a rank's repeat of its register must not be answered that registration's
    generation, which ends with the unregister; it is told to retry (409, transient)."""

    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = hold_on_all(sidecar, pools)
        claim = ClaimRequest(ticket=ticket, reader="d0", reader_tp_size=1, claim_s=60.0)
        await asyncio.wait_for(sidecar.claim(claim), 30)  # the decode may READ for a minute
        generation = sidecar.generation
        leaving = asyncio.create_task(sidecar.unregister(UnregisterRequest(generation=generation)))
        await until(lambda: sidecar._leaving, "the unregister under way")
        with pytest.raises(RegisterInProgressError, match="unregister"):
            await asyncio.wait_for(sidecar.register(pools.request(0)), 30)
        with pytest.raises(MemoryInUseError):  # the claim outlasts its wait: still registered
            await asyncio.wait_for(leaving, 30)
        again = await asyncio.wait_for(sidecar.register(pools.request(0)), 30)
        assert again.generation == generation == sidecar.generation

    run_pod(scenario, ranks=2, engine_id="pod-repeat-leaving", registered=True)


def spy_registrations(sidecar: Sidecar) -> tuple[list, list]:
    """Every NIXL registration the agent makes, and every one it drops."""
    made, dropped = [], []
    register, deregister = sidecar.agent.register, sidecar.agent.deregister

    def spy_register(regions):  # noqa: ANN001, ANN202
        out = register(regions)
        made.extend(out)
        return out

    def spy_deregister(reg):  # noqa: ANN001, ANN202
        dropped.append(reg)
        return deregister(reg)

    sidecar.agent.register, sidecar.agent.deregister = spy_register, spy_deregister
    return made, dropped


def test_the_handshake_names_every_rank_and_where_its_regions_lie():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        pools.fill(PIDS, seed=11)
        ours = sidecar._local_handshake()
        answer = await sidecar.accept_handshake(ours)  # a reader of the same layout
        assert answer.manifest.tp_rank == 0 and answer.generation == sidecar.generation
        assert [layout.manifest.tp_rank for layout in answer.pod] == [1, 2, 3]
        layouts = [(answer.manifest, answer.region_bases)] + [
            (layout.manifest, layout.region_bases) for layout in answer.pod
        ]
        for rank, (manifest, bases) in enumerate(layouts):
            assert (manifest.engine_id, manifest.epoch) == (sidecar.engine_id, sidecar.epoch)
            # The bytes at each named base are that rank's own (its pattern, not another's).
            views = [read_at(base, r.size_bytes) for base, r in zip(bases, manifest.regions,
                                                                     strict=True)]  # fmt: skip
            assert verify_pattern(manifest, views, PIDS, seed=11) is None, rank
            if rank:
                assert verify_pattern(layouts[0][0], views, PIDS, seed=11) is not None

    run_pod(scenario, ranks=4, engine_id="pod-handshake", registered=True)


def read_at(base: int, size: int) -> np.ndarray:
    """A copy of ``size`` bytes of this process's memory at ``base`` (the sidecar's mapping)."""
    return np.frombuffer(ctypes.string_at(base, size), dtype=np.uint8).copy()


def test_an_unregister_from_any_rank_ends_the_pod_and_the_ranks_register_afresh():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        old = sidecar.generation
        ticket = hold_on_all(sidecar, pools)
        await sidecar.unregister(UnregisterRequest(generation=old))  # sent by any one rank
        assert not sidecar.ready and sidecar.identity().generation == -1
        assert sidecar._regions == [] and sidecar.pod.slots.missing == [0, 1]
        with pytest.raises(NotRegisteredError):  # another rank's call of that pod
            sidecar.released_since(0)
        with pytest.raises(NotRegisteredError):
            await sidecar.unregister(UnregisterRequest(generation=old))
        new = (await register_all(sidecar, pools))[0].generation
        assert new != old
        with pytest.raises(StaleGenerationError):  # a rank still at the old pod's generation
            await sidecar.unregister(UnregisterRequest(generation=old))
        released = sidecar.released_since(0)
        assert ticket.hold_id not in {h.hold_id for h in released.holds}  # a new table

    run_pod(scenario, ranks=2, engine_id="pod-unregister", registered=True)


def test_an_unregister_releases_the_pods_holds_as_unregistered():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = hold_on_all(sidecar, pools)
        holds = sidecar.holds
        await sidecar.unregister(UnregisterRequest(generation=sidecar.generation))
        feed = holds.released_since(0)
        assert [(h.hold_id, h.reason) for h in feed.holds] == [(ticket.hold_id, "unregistered")]

    run_pod(scenario, ranks=2, engine_id="pod-unregister-holds", registered=True)


def test_a_pod_sidecar_does_not_pull():
    async def scenario(sidecar: Sidecar, pools: PodPools) -> None:
        ticket = hold_on_all(sidecar, pools)
        with pytest.raises(PodConflictError, match="pod sidecar") as exc:  # a 409, not a 500
            await sidecar.start_pull(PullRequest(tickets=[ticket], block_ids=PIDS))
        assert exc.value.field == "tickets"

    run_pod(scenario, ranks=2, engine_id="pod-no-pulls", registered=True)


def test_a_rank_whose_register_call_timed_out_registers_again_with_the_same_memory():
    """Over a real ``kvxferd serve --pod-ranks 2``: rank 0's client gives up on its register
    (its pod incomplete) while the sidecar still holds its slot; the same rank registering the
    same memory again is that register (it waits for the pod with it), not a conflict, and
    every answer carries the pod's one generation."""
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = start_sidecar(tmp, "pod-retry", "--pod-ranks", "2", env=QUIET)
        pools = PodPools(2)
        try:
            req = pools.request(0)
            with (
                sidecar.client(timeout_s=0.5) as c,
                pytest.raises(SidecarUnreachableError),  # its pod is not complete yet
            ):
                c.register(req.manifest, req.regions, instance="engine-a")
            with sidecar.client() as c:  # the slot is still held: the sidecar took the call
                assert c.identity().generation == -1
            with ThreadPoolExecutor(2) as ex:
                again = ex.submit(_register, sidecar, pools, 0, "engine-a")
                other = ex.submit(_register, sidecar, pools, 1, "engine-a")
                answers = [again.result(timeout=60), other.result(timeout=60)]
            assert answers[0].generation == answers[1].generation >= 0
            # the same again once the pod is complete: that registration's answer
            assert _register(sidecar, pools, 0, "engine-a").generation == answers[0].generation
            with pytest.raises(PodConflictError) as conflict:  # another engine's rank 0
                _register(sidecar, pools, 0, "engine-b")
            assert (conflict.value.status, conflict.value.field) == (409, "manifest.tp_rank")
        finally:
            assert sidecar.stop() == 0
            pools.close()


def _register(sidecar, pools: PodPools, rank: int, instance: str):  # noqa: ANN001, ANN202
    """Rank ``rank``'s register, tried again while the sidecar says an earlier call of it still
    maps the memory (409, transient: as the vLLM worker does), for at most 30 s."""
    req = pools.request(rank)
    deadline = time.monotonic() + 30
    with sidecar.client(timeout_s=60) as c:
        while True:
            try:
                return c.register(req.manifest, req.regions, instance=instance)
            except RegisterInProgressError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)  # the worker's first pause between tries
