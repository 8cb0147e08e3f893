"""Registration over the engine API: regions inside one allocation, unregister with a
generation (refused while an unsettled READ may still write the memory; no pull starts while it
runs; store loads and saves on the memory end before it answers), register again, and the
identity a scheduler reads to mint tickets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvxferd.api.engine import engine_app
from kvxferd.config import Config
from kvxferd.errors import UnsettledReadError
from kvxferd.memory import SharedMemoryRegion
from kvxferd.pattern import write_pattern
from kvxferd.sidecar import reads as reads_mod
from kvxferd.sidecar import service as service_mod
from kvxferd.sidecar.service import Sidecar
from kvxferd.sidecar.states import PullState
from kvxferd.store import chunk_keys
from kvxferd.store import store as store_mod
from kvxferd.transport import Transfer
from kvxferd.wire import ErrorBody, Identity, RegionSpec, RegisterRequest, RegisterResponse
from tests.api.conftest import JSON
from tests.sidecar.harness import TOKEN, EnginePool, held_on_first_call, plan, wait_until


def _one_allocation(manifest, name: str):
    """The manifest's regions laid out back to back in ONE segment (vLLM's backing buffer)."""
    offsets, at = [], 4096  # a leading gap: region 0 does not start at the allocation
    for r in manifest.regions:
        offsets.append(at)
        at += r.size_bytes
    regions = [
        msgspec.structs.replace(r, source=0, source_offset=off)
        for r, off in zip(manifest.regions, offsets, strict=True)
    ]
    shm = SharedMemoryRegion.create(name, at)
    return msgspec.structs.replace(manifest, regions=regions), shm


def _post(client, path: str, body) -> object:
    return client.post(path, content=msgspec.json.encode(body), headers=JSON)


def test_the_self_test_read_passes_without_the_background_poller(fresh):
    # Nothing started the sidecar's tasks here: the self-test must progress our UCX worker
    # itself (it once waited out its 10 s bound and failed in every in-process sidecar).
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    assert _post(fresh.engine, "/v1/register", req).status_code == 200
    assert fresh.sidecar.fabric.self_test == "ok"


def test_regions_inside_one_allocation_are_based_at_their_offsets(fresh):
    manifest, shm = _one_allocation(fresh.manifest, f"kvx-src-{id(fresh)}")
    try:
        req = RegisterRequest(
            manifest=manifest, regions=[RegionSpec(name=shm.name, size_bytes=shm.size)]
        )
        resp = _post(fresh.engine, "/v1/register", req)
        assert resp.status_code == 200, resp.text
        bases = fresh.sidecar.region_bases
        base = min(bases) - manifest.regions[0].source_offset
        assert [b - base for b in bases] == [r.source_offset for r in manifest.regions]
        assert len(fresh.sidecar._registrations) == 1  # the allocation, registered once
    finally:
        shm.close()


def test_a_region_past_its_allocation_is_a_422_naming_its_source_offset(fresh):
    manifest, shm = _one_allocation(fresh.manifest, f"kvx-src-short-{id(fresh)}")
    try:
        short = RegionSpec(name=shm.name, size_bytes=shm.size - 1)
        resp = _post(
            fresh.engine, "/v1/register", RegisterRequest(manifest=manifest, regions=[short])
        )
        assert resp.status_code == 422, resp.text
        body = msgspec.json.decode(resp.content, type=ErrorBody)
        assert body.field == f"manifest.regions[{len(manifest.regions) - 1}].source_offset"
        assert fresh.sidecar.manifest is None
    finally:
        shm.close()


def test_unregister_then_register_again_starts_the_next_generation(fresh):
    ident = msgspec.json.decode(fresh.engine.get("/v1/identity").content, type=Identity)
    assert (ident.generation, ident.tp_rank, ident.tp_size) == (-1, -1, 0)
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    first = msgspec.json.decode(
        _post(fresh.engine, "/v1/register", req).content, type=RegisterResponse
    )
    assert 0 <= first.generation < service_mod.GENERATION_SPAN  # a random start: see below
    held = fresh.engine.post(
        "/v1/holds", json={"request_id": "r1", "block_ids": [[1]], "num_tokens": 3}
    )
    assert held.status_code == 200, held.text
    assert _post(fresh.engine, "/v1/register", req).status_code == 409  # still registered
    stale = fresh.engine.post("/v1/unregister", json={"generation": first.generation + 5})
    assert stale.status_code == 409
    gone = fresh.engine.post("/v1/unregister", json={"generation": first.generation})
    assert gone.status_code == 204
    assert fresh.sidecar.holds.released_since(0).holds[0].reason == "unregistered"
    assert (
        fresh.engine.post(
            "/v1/holds", json={"request_id": "r2", "block_ids": [[1]], "num_tokens": 3}
        ).status_code
        == 503
    )
    again = msgspec.json.decode(
        _post(fresh.engine, "/v1/register", req).content, type=RegisterResponse
    )
    assert again.generation == first.generation + 1 and again.epoch == first.epoch
    ident = msgspec.json.decode(fresh.engine.get("/v1/identity").content, type=Identity)
    assert (ident.generation, ident.engine_id, ident.tp_size) == (again.generation,
                                                                  first.engine_id, 1)  # fmt: skip
    assert ident.max_claim_s == Config().max_claim_s  # how long an unregister may have to wait
    ticket = fresh.engine.post(
        "/v1/holds", json={"request_id": "r3", "block_ids": [[1]], "num_tokens": 3}
    ).json()
    assert ticket["generation"] == again.generation


def test_a_generation_kept_from_before_a_sidecar_restart_names_nothing_after_it(fresh):
    """Each sidecar process numbers its registrations from a random start. Numbered from 0,
    the first registrant after a restart was told the very number an engine still kept from
    before it, and that engine's holds and pulls landed on the other registrant's memory."""
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    kept = msgspec.json.decode(_post(fresh.engine, "/v1/register", req).content,
                               type=RegisterResponse).generation  # fmt: skip
    restarted = Sidecar(Config(peer_token=TOKEN))  # the next process at the engine's socket
    try:
        with TestClient(engine_app(restarted), raise_server_exceptions=False) as engine:
            first = _post(engine, "/v1/register", req)  # another registrant comes first
            assert first.status_code == 200, first.text
            assert first.json()["generation"] != kept
            hold = {"request_id": "r1", "block_ids": [[1]], "num_tokens": 3, "generation": kept}
            refused = engine.post("/v1/holds", json=hold)
            assert refused.status_code == 409, refused.text
            assert refused.json()["field"] == "generation"
            assert len(restarted.holds) == 0
    finally:
        asyncio.run(restarted.close())


class _Frozen:
    """The NIXL side of a READ whose peer is frozen: in flight until ``ended`` is set."""

    def __init__(self) -> None:
        self.ended = False

    def transfer(self, handle: object) -> str:
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE" if self.ended else "PROC"


def test_unregister_keeps_the_memory_while_an_unsettled_read_may_still_write_it(fresh, monkeypatch):
    monkeypatch.setattr(reads_mod, "SETTLE_S", 0.01)
    monkeypatch.setattr(reads_mod, "QUARANTINE_POLL_S", 0.001)
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    assert _post(fresh.engine, "/v1/register", req).status_code == 200
    held = fresh.engine.post(
        "/v1/holds", json={"request_id": "r1", "block_ids": [[1]], "num_tokens": 3}
    )
    assert held.status_code == 200, held.text
    sidecar = fresh.sidecar
    nixl = _Frozen()
    handle = SimpleNamespace(release=lambda: None)
    read = Transfer(nixl, handle, remote="frozen", nbytes=1, descriptors=1,
                    capture_telemetry=False, on_release=lambda _: None)  # fmt: skip
    read._post()

    async def unsettled() -> None:  # on the app's loop, as a pull's READ would be
        with pytest.raises(UnsettledReadError):
            await sidecar.pulls.reads.read("frozen:1", "frozen", None, None, b"n", nbytes=1,
                                           descs=1, deadline=time.monotonic() + 0.01,
                                           post=lambda: read)  # fmt: skip

    fresh.engine.portal.call(unsettled)
    assert sidecar.pulls.reads.unsettled == 1 and not read.released  # quarantined

    # Kept: the memory the READ may still write stays mapped and registered.
    _refused_keeping_memory(fresh.engine, sidecar, "1 READs still unsettled")
    assert not read.released
    # The engine lets its blocks go all the same: no hold outlives the refused unregister.
    assert [h.reason for h in sidecar.holds.released_since(0).holds] == ["unregistered"]

    nixl.ended = True  # the peer resumed: the READ ends on its own and leaves quarantine
    wait_until(lambda: sidecar.pulls.reads.quarantined == 0, what="the quarantine to drain")
    assert read.released
    gone = fresh.engine.post("/v1/unregister", json={"generation": sidecar.generation})
    assert gone.status_code == 204
    assert sidecar.manifest is None and sidecar._regions == []


def test_a_pull_started_while_unregister_lets_the_memory_go_is_refused(fresh, monkeypatch):
    sidecar = fresh.sidecar
    sidecar.peer_address = "127.0.0.1:9"
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
    assert _post(fresh.engine, "/v1/register", req).status_code == 200
    ticket = fresh.engine.post(
        "/v1/holds", json={"request_id": "r1", "block_ids": [[1]], "num_tokens": 3}
    ).json()
    inside, go_on = threading.Event(), threading.Event()
    deregister = sidecar.agent.deregister

    def held_deregister(reg):  # noqa: ANN001, ANN202 - unregister paused mid-way, on a thread
        inside.set()
        assert go_on.wait(30)
        return deregister(reg)

    monkeypatch.setattr(sidecar.agent, "deregister", held_deregister)
    answers: list[int] = []
    leaving = threading.Thread(
        target=lambda: answers.append(
            fresh.engine.post("/v1/unregister", json={"generation": sidecar.generation}).status_code
        )
    )
    leaving.start()
    try:
        assert inside.wait(30)
        pull = {"tickets": [ticket], "block_ids": [[2]], "request_id": "q"}
        started = fresh.engine.post("/v1/pulls", json=pull)
        # Refused: a pull started now would READ into memory that is being unmapped.
        assert started.status_code == 503, started.text
        assert "unregistering" in msgspec.json.decode(started.content, type=ErrorBody).detail
    finally:
        go_on.set()
        leaving.join(30)
    assert answers == [204] and sidecar.manifest is None


def test_unregister_cancels_a_running_pull_which_ends_failed_cancelled(fresh):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: a handshake hangs
    try:
        sidecar = fresh.sidecar
        sidecar.peer_address = f"127.0.0.1:{silent.getsockname()[1]}"
        req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs())
        assert _post(fresh.engine, "/v1/register", req).status_code == 200
        ticket = fresh.engine.post(
            "/v1/holds", json={"request_id": "r1", "block_ids": [[1]], "num_tokens": 3}
        ).json()
        pull = {"tickets": [ticket], "block_ids": [[2]], "request_id": "q", "deadline_s": 60}
        started = fresh.engine.post("/v1/pulls", json=pull)
        assert started.status_code == 202, started.text
        pull_id = started.json()["pull_id"]
        running = sidecar.pulls._pulls[pull_id]
        wait_until(lambda: running.state is PullState.HANDSHAKING, what="the handshake to hang")
        gone = fresh.engine.post("/v1/unregister", json={"generation": sidecar.generation})
        assert gone.status_code == 204
        status = running.status()
        assert (status.state, status.reason) == ("failed", "cancelled"), status
        assert sidecar.manifest is None and sidecar._regions == []
    finally:
        silent.close()


# ------------------------------------------------------------------------------------------------
# Store loads and saves copy into and out of the engine's memory on worker threads: unregister
# answers only once none of them can touch it any more.

_CHUNKS = 3  # chunks (one block each) of the stored request


@pytest.fixture
def stored(tmp_path) -> Iterator[SimpleNamespace]:
    """A real Sidecar with a store, registered; blocks 1-3 hold a request saved in the store."""
    manifest = plan("llama-3.1-8b", num_blocks=8)
    tokens = _CHUNKS * manifest.groups[0].block_size
    pool = EnginePool(manifest)
    config = Config(peer_token=TOKEN, store_dir=str(tmp_path / "store"),
                    store_chunk_tokens=manifest.groups[0].block_size)  # fmt: skip
    sidecar = Sidecar(config)
    try:
        with TestClient(engine_app(sidecar), raise_server_exceptions=False) as engine:
            req = RegisterRequest(manifest=manifest, regions=pool.specs())
            assert _post(engine, "/v1/register", req).status_code == 200
            saved = [[1, 2, 3]]
            write_pattern(manifest, pool.views, saved, seed=7)
            keys = chunk_keys(list(range(tokens)), manifest.groups[0].block_size)
            save = {"request_id": "r", "block_ids": saved, "keys": keys, "num_tokens": tokens}
            answer = engine.post("/v1/store/save", json=save)
            assert answer.status_code == 200, answer.text
            assert answer.json()["chunks_saved"] == _CHUNKS
            yield SimpleNamespace(sidecar=sidecar, engine=engine, pool=pool, manifest=manifest,
                                  keys=keys, tokens=tokens, save=save)  # fmt: skip
    finally:
        asyncio.run(sidecar.close())
        pool.close()


def _in_thread(call) -> tuple[threading.Thread, list]:  # noqa: ANN001
    """Run ``call`` on a thread; its result lands in the list."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    return thread, out


def _stopping(sidecar: Sidecar) -> bool:
    """Whether an unregister has asked the store work in progress to stop."""
    return any(stop.is_set() for stop in list(sidecar.offload._running.values()))


def _unregister_while_held(sidecar, inside, go_on, work, unregister, what: str) -> list:
    """Once ``work``'s thread is held inside its first copy (``inside``), run ``unregister`` on
    a thread; let the copy go on (``go_on``) once unregister answered or asked the store work to
    stop. What ``unregister`` returned (one item)."""
    try:
        assert inside.wait(30)
        leaving, left = _in_thread(unregister)
        wait_until(lambda: left or _stopping(sidecar), what=f"unregister to {what}")
    finally:
        go_on.set()
        work.join(30)
    leaving.join(30)
    return left


def _refused_keeping_memory(engine, sidecar: Sidecar, why: str) -> None:
    """Unregister answers 503 MemoryInUseError saying ``why``; the registration's regions and
    NIXL registrations stay as they were."""
    regions, registrations = list(sidecar._regions), list(sidecar._registrations)
    generation = sidecar.generation
    refused = engine.post("/v1/unregister", json={"generation": generation})
    assert refused.status_code == 503, refused.text
    body = msgspec.json.decode(refused.content, type=ErrorBody)
    assert body.error == "MemoryInUseError" and why in body.detail
    assert sidecar.generation == generation and sidecar.manifest is not None
    assert sidecar._regions == regions and sidecar._registrations == registrations


def test_unregister_answers_after_a_store_load_stopped_writing_the_memory(stored, monkeypatch):
    sidecar, pool = stored.sidecar, stored.pool
    before = pool.snapshot()
    inside, go_on = held_on_first_call(store_mod, "scatter_attention", monkeypatch)
    load = {"block_ids": [[4, 5, 6]], "keys": stored.keys, "num_tokens": stored.tokens}
    loading, loaded = _in_thread(lambda: stored.engine.post("/v1/store/load", json=load))

    def unregister():  # noqa: ANN202 - the answer, and the engine's memory as it was then
        answer = stored.engine.post("/v1/unregister", json={"generation": sidecar.generation})
        return answer.status_code, pool.snapshot()

    # The load is in the middle of copying its first entry.
    left = _unregister_while_held(sidecar, inside, go_on, loading, unregister, "stop the load")
    [(status, at_answer)] = left
    assert status == 204
    # Nothing the load did changed the memory after unregister answered.
    for now, then in zip(pool.views, at_answer, strict=True):
        assert np.array_equal(now, then)
    answer = loaded[0].json()
    assert (answer["state"], answer["reason"]) == ("failed", "cancelled"), answer
    # The entry being copied finished (block 4 holds chunk 0); the next chunks' were not written.
    want = before
    write_pattern(stored.manifest, want, [[4]], seed=7)
    for now, expected in zip(pool.views, want, strict=True):
        assert np.array_equal(now, expected)
    assert sidecar.manifest is None and sidecar._regions == []


def test_unregister_answers_after_a_store_save_stopped_reading_the_memory(stored, monkeypatch):
    sidecar = stored.sidecar
    inside, go_on = held_on_first_call(store_mod, "gather_attention", monkeypatch)
    ended = threading.Event()
    save = sidecar.offload.store.save

    def saving(*args):  # noqa: ANN002, ANN202 - the save's worker thread
        try:
            return save(*args)
        finally:
            ended.set()

    monkeypatch.setattr(sidecar.offload.store, "save", saving)
    chunk = stored.manifest.groups[0].block_size
    again = {**stored.save, "keys": chunk_keys([9] * stored.tokens, chunk)}  # not stored yet
    saver, saved = _in_thread(lambda: stored.engine.post("/v1/store/save", json=again))

    def unregister():  # noqa: ANN202 - the answer, and whether the save had ended then
        answer = stored.engine.post("/v1/unregister", json={"generation": sidecar.generation})
        return answer.status_code, ended.is_set()

    # The save is in the middle of gathering its first entry.
    left = _unregister_while_held(sidecar, inside, go_on, saver, unregister, "wait for the save")
    assert left == [(204, True)]  # answered only once the save no longer read the memory
    # The save stopped after the entry it was copying: it read no more of the memory.
    assert saved[0].status_code == 200 and saved[0].json()["chunks_saved"] == 1 < _CHUNKS


def test_unregister_keeps_the_memory_while_a_store_load_does_not_stop(stored, monkeypatch):
    monkeypatch.setattr(service_mod, "STOP_S", 0.01)
    sidecar = stored.sidecar
    inside, go_on = held_on_first_call(store_mod, "scatter_attention", monkeypatch)
    load = {"block_ids": [[4, 5, 6]], "keys": stored.keys, "num_tokens": stored.tokens}
    loading, loaded = _in_thread(lambda: stored.engine.post("/v1/store/load", json=load))
    try:
        assert inside.wait(30)  # one entry's copy that does not end
        # Kept: the memory the load still writes stays mapped and registered.
        _refused_keeping_memory(stored.engine, sidecar, "1 store loads or saves")
    finally:
        go_on.set()
        loading.join(30)
    assert loaded[0].json()["reason"] == "cancelled"  # it stopped after that entry
    gone = stored.engine.post("/v1/unregister", json={"generation": sidecar.generation})
    assert gone.status_code == 204
    assert sidecar.manifest is None and sidecar._regions == []


def test_the_identity_names_the_registered_engines_instance_until_it_unregisters(fresh):
    req = RegisterRequest(manifest=fresh.manifest, regions=fresh.pool.specs(), instance="e-1.a")
    assert _post(fresh.engine, "/v1/register", req).status_code == 200
    ident = msgspec.json.decode(fresh.engine.get("/v1/identity").content, type=Identity)
    assert (ident.generation, ident.instance) == (fresh.sidecar.generation, "e-1.a")
    assert ident.generation >= 0
    gone = fresh.engine.post("/v1/unregister", json={"generation": ident.generation})
    assert gone.status_code == 204
    ident = msgspec.json.decode(fresh.engine.get("/v1/identity").content, type=Identity)
    assert (ident.generation, ident.instance) == (-1, "")
    bad = msgspec.json.encode(req).replace(b'"e-1.a"', b'"e 1"')
    refused = fresh.engine.post("/v1/register", content=bad, headers=JSON)
    assert refused.status_code == 422 and "instance" in refused.json()["field"], refused.text


def _pull_body(stored, generation: int) -> dict:
    """A pull into blocks 4-6 (its ticket is never looked at: the generation is checked first)."""
    ticket = {"engine_id": "p", "epoch": 1, "hold_id": "h1", "request_id": "r", "block_ids": [[1]],
              "num_tokens": 3, "expires_at": time.time() + 60, "tp_rank": 0, "tp_size": 1,
              "peer": "127.0.0.1:1", "token": "0" * 64}  # fmt: skip
    return {"tickets": [ticket], "block_ids": [[4]], "num_tokens": 3, "generation": generation}


@pytest.mark.parametrize("other", ["next", "none"])
@pytest.mark.parametrize("call", ["holds", "pulls", "pulls/run", "store/save", "store/load"])
def test_a_call_naming_another_registration_is_refused_and_touches_nothing(stored, call, other):
    """Two engines given one socket: the one registered earlier still sends block ids meaning
    its own memory, which the sidecar no longer has. Each call names its generation and is
    refused (409 naming the field): nothing is held, pulled, saved or written."""
    sidecar, pool, engine = stored.sidecar, stored.pool, stored.engine
    registered = sidecar.generation
    generation = registered + 1 if other == "next" else -1
    chunk = stored.manifest.groups[0].block_size
    other_keys = chunk_keys([5] * stored.tokens, chunk)  # not in the store
    bodies = {
        "holds": {"request_id": "r9", "block_ids": [[1, 2, 3]], "num_tokens": stored.tokens},
        "pulls": _pull_body(stored, generation),
        "pulls/run": _pull_body(stored, generation),
        "store/save": {**stored.save, "keys": other_keys},
        "store/load": {"block_ids": [[4, 5, 6]], "keys": stored.keys, "num_tokens": stored.tokens},
    }
    before = pool.snapshot()
    refused = engine.post(f"/v1/{call}", json={**bodies[call], "generation": generation})
    assert refused.status_code == 409, refused.text
    body = msgspec.json.decode(refused.content, type=ErrorBody)
    assert (body.error, body.field) == ("StaleGenerationError", "generation")
    assert f"generation: {generation} is not the registered {registered}" in body.detail
    assert len(sidecar.holds) == 0 and not sidecar.pulls._pulls
    lookup = {"keys": other_keys, "num_tokens": stored.tokens}
    assert engine.post("/v1/store/lookup", json=lookup).json()["matched"] == 0
    for now, then in zip(pool.views, before, strict=True):
        assert np.array_equal(now, then)
    # The registration's own generation, or none, is served.
    if call in ("holds", "store/load", "store/save"):
        for i, named in enumerate(({"generation": registered}, {})):
            ok = {**bodies[call], **named, "request_id": f"ok{i}"}
            served = engine.post(f"/v1/{call}", json=ok)
            assert served.status_code == 200, served.text
