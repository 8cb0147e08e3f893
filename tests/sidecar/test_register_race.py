"""Two registers that arrive together leave one registration: the second is refused (409) while
the first still maps and registers its memory, so no two engines are ever told the same
generation, and the refused one's memory is neither kept mapped nor registered with NIXL. An
unregister that arrives while a register is still setting up is refused (503) until it ends.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly on
one event loop so the second register lands while the first awaits its NIXL registration.
"""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.errors import (
    AlreadyRegisteredError,
    MemoryInUseError,
    RegisterInProgressError,
    StaleGenerationError,
)
from kvxferd.sidecar.service import Sidecar
from kvxferd.wire import HoldRequest, RegisterRequest, UnregisterRequest
from tests.sidecar.harness import EnginePool, plan
from tests.sidecar.inprocess import run_in_process

pytestmark = pytest.mark.nixl


def test_a_register_while_another_is_in_progress_is_refused_and_keeps_nothing():
    async def two_at_once(sidecar: Sidecar, first: RegisterRequest) -> None:
        other = EnginePool(plan("llama-3.1-8b", num_blocks=8))  # a second engine's memory
        try:
            second = RegisterRequest(manifest=other.manifest, regions=other.specs(),
                                     instance="engine-b")  # fmt: skip
            first = RegisterRequest(manifest=first.manifest, regions=first.regions,
                                    instance="engine-a")  # fmt: skip
            a, b = await asyncio.gather(
                sidecar.register(first), sidecar.register(second), return_exceptions=True
            )
            assert isinstance(b, RegisterInProgressError), b  # transient: an engine retries
            assert not isinstance(a, BaseException), a
            assert (sidecar.generation, sidecar.instance) == (a.generation, "engine-a")
            assert len(sidecar._regions) == len(first.regions)  # b's memory was not mapped
            # Engine b, told nothing, cannot place a hold on a's memory under any generation.
            with pytest.raises(StaleGenerationError):
                sidecar.hold(HoldRequest(request_id="rb", block_ids=[[1]], num_tokens=16,
                                         generation=a.generation + 1))  # fmt: skip
            # Once a's register ended, a register is refused as before (an engine is there).
            with pytest.raises(AlreadyRegisteredError, match="already has an engine") as got:
                await sidecar.register(second)
            assert not isinstance(got.value, RegisterInProgressError)
        finally:
            other.close()

    run_in_process(two_at_once, engine_id="register-race")


def test_an_unregister_while_the_register_runs_its_self_test_is_refused_until_it_ends():
    """The registration is published before its self-test READ of the memory; an unregister
    meanwhile (a restarted engine read the identity) would unmap what that READ reads, so it
    is refused (503, retried) until the register has answered. A register meanwhile is told
    the first is in progress (which an engine retries), not that an engine is registered."""

    async def unregister_during_self_test(sidecar: Sidecar, register: RegisterRequest) -> None:
        testing, go_on = asyncio.Event(), asyncio.Event()
        self_test = sidecar.fabric.run_self_test

        async def paused(*args: object) -> None:  # the real self-test, once let go
            testing.set()
            await go_on.wait()
            await self_test(*args)

        sidecar.fabric.run_self_test = paused  # type: ignore[method-assign]
        registering = asyncio.create_task(sidecar.register(register))
        await asyncio.wait_for(testing.wait(), 30)
        with pytest.raises(MemoryInUseError, match="still being set up"):
            await sidecar.unregister(UnregisterRequest(generation=sidecar.generation))
        assert sidecar.manifest is not None and len(sidecar._regions) == len(register.regions)
        with pytest.raises(RegisterInProgressError):
            await sidecar.register(register)
        go_on.set()
        answer = await asyncio.wait_for(registering, 30)
        assert sidecar.fabric.self_test == "ok"
        await sidecar.unregister(UnregisterRequest(generation=answer.generation))
        assert sidecar.manifest is None and sidecar._regions == []

    run_in_process(unregister_during_self_test, engine_id="register-self-test")
