"""Engine calls that reach a stalled sidecar after the engine gave them up do nothing.

The engine's client gives a call up at its timeout; the engine then frees or reuses the blocks
(vLLM recomputes them). A sidecar that was stopped meanwhile still reads the call afterwards.
Each test stops a real ``kvxferd serve`` (SIGSTOP), lets the call time out over the framed
protocol (the vLLM worker's), has the engine reuse the blocks, lets the sidecar go on, and checks
that the late call touched nothing: no hold a decode could read, no store entry of the reused
blocks, no byte written. A call whose ``not_after_ns`` has passed is a 408 without any stall.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest

from kvxferd.client import EngineClient, SidecarUnreachableError, frames_available
from kvxferd.config import Config
from kvxferd.errors import CallExpiredError, UnknownHoldError
from kvxferd.pattern import write_pattern
from kvxferd.sidecar.service import Sidecar as InProcessSidecar
from kvxferd.sidecar.states import PullState
from kvxferd.store import chunk_keys
from kvxferd.wire import (
    HoldRequest,
    PullRequest,
    RegisterRequest,
    StoreLoadRequest,
    StoreSaveRequest,
)
from kvxferd.wire import StoreLookupRequest as Lookup
from tests.sidecar.harness import (
    QUIET,
    SENTINEL,
    TOKEN,
    EnginePool,
    Sidecar,
    metric,
    plan,
    start_sidecar,
    wait_until,
)
from tests.sidecar.ranks import DIDS, PIDS, Engine, engine_pair
from tests.store.helpers import block_ids

pytestmark = pytest.mark.nixl
GIVE_UP_S = 0.5
"""The engine's call timeout in these tests (the worker's is 30 s: the story is the same)."""
CHUNK, TOKENS = 16, 64


def _client(sidecar: Sidecar) -> EngineClient:
    assert frames_available(sidecar.socket)
    return EngineClient(sidecar.socket, timeout_s=GIVE_UP_S, frames=True)


def _not_after() -> int:
    """When the engine gives a call sent now up (its client's timeout)."""
    return time.monotonic_ns() + int(GIVE_UP_S * 1e9)


@contextlib.contextmanager
def _stopped(sidecar: Sidecar) -> Iterator[None]:
    os.kill(sidecar.child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sidecar.child.pid, signal.SIGCONT)


def _given_up(call: Callable[[], object]) -> None:
    with pytest.raises(SidecarUnreachableError, match="no answer in time"):
        call()


def _late_call_handled(sidecar: Sidecar, op: str, acted: Callable[[], bool]) -> None:
    """Bounded wait until the sidecar read the late call: refused (counted), or acted on."""
    expired = lambda: metric(sidecar.peer, "kvxferd_engine_calls_expired_total", op=op)  # noqa: E731
    wait_until(lambda: expired() == 1 or acted(), what=f"the late {op} call handled")
    assert expired() == 1, f"the late {op} call was acted on"


def _store_sidecar(tmp_path) -> tuple[Sidecar, EnginePool, list[list[int]], list[str]]:  # noqa: ANN001
    manifest = plan("llama-3.1-8b", num_blocks=16)
    pool = EnginePool(manifest)
    ids = block_ids(manifest, TOKENS)
    keys = chunk_keys(list(range(TOKENS)), CHUNK)
    flags = ("--store-dir", str(tmp_path / "store"), "--store-chunk-tokens", str(CHUNK))
    sidecar = start_sidecar(str(tmp_path), "s", *flags)
    with sidecar.client() as c:
        c.register(manifest, pool.specs())
    return sidecar, pool, ids, keys


def test_a_store_save_that_comes_after_the_engine_gave_it_up_stores_nothing(tmp_path):
    sidecar, pool, ids, keys = _store_sidecar(tmp_path)
    try:
        write_pattern(pool.manifest, pool.views, ids, seed=3)  # the finished request's KV
        req = StoreSaveRequest(request_id="r", keys=keys, block_ids=ids, num_tokens=TOKENS,
                               not_after_ns=_not_after())  # fmt: skip
        with _client(sidecar) as c, _stopped(sidecar):
            _given_up(lambda: c.store_save(req))
            write_pattern(pool.manifest, pool.views, ids, seed=4)  # the blocks reused
        with sidecar.client() as c:
            matched = lambda: c.store_lookup(Lookup(keys=keys, num_tokens=TOKENS)).matched  # noqa: E731
            _late_call_handled(sidecar, "store_save", lambda: matched() > 0)
            assert matched() == 0  # before: the reused blocks' KV under this prompt's keys
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_store_load_that_comes_after_the_engine_gave_it_up_writes_nothing(tmp_path):
    sidecar, pool, ids, keys = _store_sidecar(tmp_path)
    try:
        write_pattern(pool.manifest, pool.views, ids, seed=3)
        with sidecar.client() as c:
            saved = c.store_save(StoreSaveRequest(request_id="r", keys=keys, block_ids=ids,
                                                  num_tokens=TOKENS))  # fmt: skip
        assert saved.chunks_saved == TOKENS // CHUNK
        into = [[b + TOKENS // pool.manifest.groups[0].block_size for b in g] for g in ids]
        req = StoreLoadRequest(keys=keys, block_ids=into, num_tokens=TOKENS,
                               not_after_ns=_not_after())  # fmt: skip
        with _client(sidecar) as c, _stopped(sidecar):
            _given_up(lambda: c.store_load(req))
            write_pattern(pool.manifest, pool.views, into, seed=9)  # vLLM recomputes them
            recomputed = pool.snapshot()
        _late_call_handled(sidecar, "store_load", lambda: _changed(pool, recomputed))
        assert not _changed(pool, recomputed)  # before: the store's KV over the recomputed
    finally:
        assert sidecar.stop() == 0
        pool.close()


def _changed(pool: EnginePool, before: list) -> bool:  # noqa: ANN001
    return any((a != b).any() for a, b in zip(pool.views, before, strict=True))


def test_a_hold_that_comes_after_the_engine_gave_it_up_is_never_placed(tmp_path):
    with engine_pair(str(tmp_path)) as (prefill, _decode):
        side = prefill.sidecar
        req = HoldRequest(request_id="r", block_ids=PIDS, num_tokens=60, hold_id="h-late")
        with _client(side) as c, _stopped(side):
            _given_up(lambda: c.hold(req))  # stamped by the client: its own timeout
        created = lambda: metric(side.peer, "kvxferd_holds_created_total") > 0  # noqa: E731
        _late_call_handled(side, "hold", created)
        with side.client() as c, pytest.raises(UnknownHoldError):
            c.abort("h-late")  # the engine's give-up finds nothing: it frees the blocks
        assert not created()  # before: placed after the abort, readable over reused blocks


def test_a_pull_that_comes_after_the_engine_gave_it_up_reads_nothing(tmp_path):
    with engine_pair(str(tmp_path)) as (prefill, decode):
        ticket = prefill.hold("r")
        req = PullRequest(tickets=[ticket], block_ids=DIDS, request_id="r", deadline_s=20.0,
                          not_after_ns=_not_after())  # fmt: skip
        with _client(decode.sidecar) as c, _stopped(decode.sidecar):
            _given_up(lambda: c.pull(req))
            write_pattern(decode.manifest, decode.pool.views, DIDS, seed=11)  # recomputed
            recomputed = decode.pool.snapshot()
        with decode.sidecar.client() as c:
            started = lambda: bool(c.finished_pulls(0).pulls) or _changed(decode.pool, recomputed)  # noqa: E731
            _late_call_handled(decode.sidecar, "pull", started)
            assert not c.finished_pulls(0).pulls
        assert not _changed(decode.pool, recomputed)  # before: the prefill's KV over them
        prefill.abort(ticket)
        prefill.released_once(ticket, "aborted")  # never claimed


def test_each_call_past_its_not_after_is_a_408_naming_it_and_counted(tmp_path):
    sidecar, pool, ids, keys = _store_sidecar(tmp_path)
    past = time.monotonic_ns() - 1
    calls = {
        "hold": lambda c: c.hold(HoldRequest(request_id="r", block_ids=ids, num_tokens=TOKENS,
                                             not_after_ns=past)),  # fmt: skip
        "store_save": lambda c: c.store_save(StoreSaveRequest(
            request_id="r", keys=keys, block_ids=ids, num_tokens=TOKENS, not_after_ns=past)),
        "store_load": lambda c: c.store_load(StoreLoadRequest(
            keys=keys, block_ids=ids, num_tokens=TOKENS, not_after_ns=past)),
    }  # fmt: skip
    try:
        for frames in (False, True):
            with EngineClient(sidecar.socket, frames=frames) as c:
                for op, call in calls.items():
                    with pytest.raises(CallExpiredError) as err:
                        call(c)
                    assert (err.value.status, err.value.field) == (408, "not_after_ns")
                    assert metric(sidecar.peer, "kvxferd_engine_calls_expired_total",
                                  op=op) == 1 + frames  # fmt: skip
        assert metric(sidecar.peer, "kvxferd_holds_created_total") == 0
        with sidecar.client() as c:
            assert c.store_lookup(Lookup(keys=keys, num_tokens=TOKENS)).matched == 0
    finally:
        assert sidecar.stop() == 0
        pool.close()


def test_a_pull_whose_sidecar_stalled_past_its_not_after_before_it_ran_posts_no_read(
    tmp_path, monkeypatch
):
    """An in-process decode sidecar (real NIXL agent) whose loop is blocked from the moment it
    accepted a pull until past the pull's ``not_after_ns``: the pull then ends FAILED without a
    READ (its peer already handshaken, nothing else stood between its start and the post)."""
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    prefill = Engine(start_sidecar(str(tmp_path), "prefill", env=QUIET)).register()
    pool = EnginePool(Engine.plan())

    async def main() -> None:
        sc = InProcessSidecar(Config(peer_token=TOKEN, engine_id="late-decode"))
        sc.start()
        try:
            await sc.register(RegisterRequest(manifest=pool.manifest, regions=pool.specs()))
            first = sc.pulls.start(PullRequest(tickets=[await asyncio.to_thread(
                prefill.hold, "warm")], block_ids=DIDS, deadline_s=20.0))  # fmt: skip
            async with asyncio.timeout(30):
                await first.done.wait()
            assert first.state is PullState.DONE, first.status()  # the peer is cached now
            for v in pool.views:
                v[:] = SENTINEL  # what vLLM recomputes once the engine gave the pull up
            ticket = await asyncio.to_thread(prefill.hold, "late", seed=6)
            pull = sc.pulls.start(PullRequest(tickets=[ticket], block_ids=DIDS, deadline_s=20.0,
                                              not_after_ns=_not_after()))  # fmt: skip
            end = pull.ends_by
            while time.monotonic() <= end:  # the loop blocked (a stalled sidecar), then goes on
                pass
            async with asyncio.timeout(30):
                await pull.done.wait()
            assert pull.state is PullState.FAILED, pull.status()
            assert pull.reason == "deadline", pull.status()
        finally:
            await sc.close()

    try:
        asyncio.run(main())
        assert all(bool((v == SENTINEL).all()) for v in pool.views)  # before: the prefill's KV
    finally:
        pool.close()
        prefill.close()
        assert prefill.sidecar.stop() == 0
