"""Shutdown and the store's copies: ``Sidecar.close`` stops the store loads and saves and waits
up to ``STOP_S`` for them, as unregister does. One that still copies an entry after that keeps
what it copies from and into: the engine's regions are not unmapped under it and the store is
not shut under it (it ends as it would have, answering what it did). Every wait is bounded: a
store I/O thread that never ends (a hung disk) does not hang shutdown.

An in-process Sidecar over POSIX shm (its self-test READ over NIXL loopback), driven directly
on one event loop; a copy is held in the middle of its first entry by an event.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import pytest

from kvxferd.config import Config
from kvxferd.pattern import write_pattern
from kvxferd.sidecar import service
from kvxferd.sidecar.service import Sidecar
from kvxferd.store import chunk_keys
from kvxferd.store import store as store_mod
from kvxferd.wire import RegisterRequest, StoreSaveRequest
from tests.sidecar.harness import TOKEN, EnginePool, held_on_first_call, plan

pytestmark = pytest.mark.nixl

CHUNKS = 3  # chunks of the saved request, one block each
BOUND_S = 30.0  # no step of a test waits longer


def _run(tmp_path, scenario: Callable[[Sidecar, RegisterRequest, EnginePool], Awaitable[None]]):  # noqa: ANN001
    """``scenario(sidecar, register, pool)`` over a llama-3.1-8b pool of 8 blocks and a store of
    one block per chunk; the scenario closes the sidecar itself (once; here if it failed before)."""
    manifest = plan("llama-3.1-8b", num_blocks=8)
    pool = EnginePool(manifest)
    config = Config(peer_token=TOKEN, engine_id="shutdown-store", store_dir=str(tmp_path),
                    store_chunk_tokens=manifest.groups[0].block_size)  # fmt: skip
    sidecar = Sidecar(config)
    sidecar.peer_address = "127.0.0.1:9"

    async def main() -> None:
        try:
            await scenario(sidecar, RegisterRequest(manifest=manifest, regions=pool.specs()), pool)
        finally:
            if not sidecar.agent.closed:
                await asyncio.wait_for(sidecar.close(), BOUND_S)

    try:
        asyncio.run(main())
    finally:
        pool.close()


async def _held_save(
    sidecar: Sidecar, register: RegisterRequest, pool: EnginePool, inside: threading.Event
) -> tuple[StoreSaveRequest, list, store_mod.Store, asyncio.Future]:
    """Register, start a save and wait until it copies its first entry: the save's request,
    the sidecar's regions, its store and the running save."""
    await sidecar.register(register)
    req = _save(sidecar, pool)
    regions, store = list(sidecar._regions), sidecar.offload.store
    assert store is not None
    saving = asyncio.ensure_future(sidecar.offload.save(req))
    assert await asyncio.to_thread(inside.wait, BOUND_S)  # copying its first entry
    return req, regions, store, saving


def _save(sidecar: Sidecar, pool: EnginePool) -> StoreSaveRequest:
    """A save of blocks 1-3 (their pattern written), one chunk each."""
    manifest = sidecar.manifest
    assert manifest is not None
    tokens = CHUNKS * manifest.groups[0].block_size
    write_pattern(manifest, pool.views, [[1, 2, 3]], seed=7)
    keys = chunk_keys(list(range(tokens)), manifest.groups[0].block_size)
    return StoreSaveRequest(request_id="r", block_ids=[[1, 2, 3]], keys=keys, num_tokens=tokens)


def test_shutdown_keeps_the_memory_and_the_store_while_a_save_still_copies_an_entry(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(service, "STOP_S", 0.01)  # the save outlives shutdown's wait
    inside, go_on = held_on_first_call(store_mod, "gather_attention", monkeypatch, BOUND_S)

    async def scenario(sidecar: Sidecar, register: RegisterRequest, pool: EnginePool) -> None:
        req, regions, store, saving = await _held_save(sidecar, register, pool, inside)
        try:
            with caplog.at_level(logging.WARNING):
                await asyncio.wait_for(sidecar.close(), BOUND_S)  # bounded though it runs
            # What the copy reads from is still mapped; the store it writes to still open.
            assert not any(region.closed for region in regions)
            assert "1 store loads or saves still copy" in caplog.text
        finally:
            go_on.set()
        saved = await asyncio.wait_for(saving, BOUND_S)
        # It ended as an unregister's stop ends it: after the entry it was copying, kept.
        assert saved.chunks_saved == 1 < CHUNKS
        assert store.lookup(register.manifest, req.keys, req.num_tokens).matched > 0
        store.close()

    _run(tmp_path, scenario)


def test_shutdown_unmaps_the_memory_and_closes_the_store_once_the_copies_stopped(
    tmp_path, monkeypatch
):
    inside, go_on = held_on_first_call(store_mod, "gather_attention", monkeypatch, BOUND_S)

    async def scenario(sidecar: Sidecar, register: RegisterRequest, pool: EnginePool) -> None:
        _, regions, store, saving = await _held_save(sidecar, register, pool, inside)
        try:
            [asked_to_stop] = sidecar.offload._running.values()  # the save's stop event

            def let_go_once_stopped() -> None:  # the copy ends within shutdown's wait
                if asked_to_stop.wait(BOUND_S):
                    go_on.set()

            relay = asyncio.ensure_future(asyncio.to_thread(let_go_once_stopped))
            await asyncio.wait_for(sidecar.close(), BOUND_S)
        finally:
            go_on.set()
        await relay
        assert all(region.closed for region in regions)
        assert (await saving).chunks_saved == 1
        with pytest.raises(RuntimeError):  # its I/O threads are gone
            store._io.submit(int)

    _run(tmp_path, scenario)


def test_a_store_io_thread_that_never_ends_does_not_hang_shutdown(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "STOP_S", 0.01)
    hung, let_go = threading.Event(), threading.Event()

    def hung_disk_write() -> None:
        hung.set()
        assert let_go.wait(BOUND_S)

    async def scenario(sidecar: Sidecar, register: RegisterRequest, pool: EnginePool) -> None:
        await sidecar.register(register)
        store = sidecar.offload.store
        assert store is not None
        writing = store._io.submit(hung_disk_write)  # left by a save that failed after it
        try:
            assert await asyncio.to_thread(hung.wait, BOUND_S)
            await asyncio.wait_for(sidecar.close(), BOUND_S / 2)
            assert not writing.done()  # close returned while the write still hangs
        finally:
            let_go.set()
        writing.result(BOUND_S)

    _run(tmp_path, scenario)
