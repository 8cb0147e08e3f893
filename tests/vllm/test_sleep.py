"""vLLM's sleep mode through the real worker glue: ``unregister_kv_caches`` lets the sidecar go of
the KV cache and refuses every ticket of that registration generation (a pull with one fails,
writing nothing); ``restore_kv_caches`` registers the same tensors under a new generation, the
scheduler re-reads identities, and a new request moves byte-exact."""

from __future__ import annotations

import contextlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import msgspec
import pytest

import kvxferd
from kvxferd import pattern
from kvxferd.errors import ConfigError, MemoryInUseError, NotRegisteredError, PathInUseError
from kvxferd.vllm import worker as worker_module
from kvxferd.vllm.connector import KvxferdConnector
from kvxferd.vllm.scheduler import SchedulerSide, StepOrders
from kvxferd.wire import ClaimRequest, Ticket
from tests.sidecar.harness import (
    changed_outside,
    peer_signature,
    start_sidecars,
    wait_until,
)
from tests.vllm.ranks import Rank, finish, prefill_side, step_until, worker_pair

pytestmark = pytest.mark.nixl
N = 300  # tokens: three 128-token blocks


def _scheduler(p_side) -> SchedulerSide:  # noqa: ANN001
    """The prefill's scheduler side, reading its one rank's identity from ``p_side``."""

    def identities():
        with p_side.client() as c:
            return [c.identity()]

    return prefill_side(identities, 128)


def _finished(sched: SchedulerSide, rid: str, ids: list[int]) -> dict:
    """The prefill finishes ``rid`` on blocks ``ids``: the kv_transfer_params it returns."""
    delay, params = finish(sched, rid, [ids], N)
    assert delay and params["kvxferd_tickets"]
    return params


def _pull(sched: SchedulerSide, decode: Rank, rid: str, params: dict, ids: list[int]):
    """The decode loads ``rid`` into ``ids``: (finished requests, load-error blocks)."""
    dreq = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(N)),
                           kv_transfer_params=dict(params))  # fmt: skip
    count, is_async = sched.matched_tokens(dreq, 0)
    assert is_async and count == N
    sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: [ids]), count)
    done = step_until(decode, sched.take_orders(), 1, 60, f"pull {rid} to end")
    return done, decode.connector.get_block_ids_with_load_errors()


def _claim(p_side, params: dict) -> None:  # noqa: ANN001
    """A slow decode claims the first ticket of ``params`` over the signed peer API, for longer
    than one unregister waits (5 s), and never READs nor notifies."""
    ticket = msgspec.convert(params["kvxferd_tickets"][0], Ticket)
    claim = ClaimRequest(ticket=ticket, reader="slow-decode", reader_tp_size=1, claim_s=8.0)
    raw = msgspec.json.encode(claim)
    headers = {"Authorization": peer_signature(p_side, "POST", "/v1/claims", raw),
               "Content-Type": "application/json"}  # fmt: skip
    resp = httpx.post(f"http://{p_side.peer}/v1/claims", content=raw, headers=headers,
                      timeout=30)  # fmt: skip
    assert resp.status_code == 200, resp.text


@contextlib.contextmanager
def _claimed_hold(engines, tmp_path):  # noqa: ANN001
    """A prefill rank beside its sidecar whose request "r1" is held on blocks 1-3, the hold
    claimed by a slow decode: (prefill, its sidecar, its scheduler side)."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, _decode, p_side):
        sched = _scheduler(p_side)
        params = _finished(sched, "r1", [1, 2, 3])
        assert prefill.step(sched.take_orders()) == (None, None)  # hold placed
        _claim(p_side, params)
        yield prefill, p_side, sched


def test_sleep_refuses_old_tickets_and_wake_moves_new_requests_byte_exact(engines, tmp_path):
    assert KvxferdConnector.supports_sleep_mode(None)
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, decode, p_side):
        sched = _scheduler(p_side)
        old = _finished(sched, "r1", [1, 2, 3])
        registered = prefill.connector._worker.generation
        assert old["remote_registration_generation"] == registered >= 0
        pattern.write_pattern(prefill.manifest, prefill.arrays(), [[1, 2, 3]], seed=5)
        assert prefill.step(sched.take_orders()) == (None, None)  # hold placed

        prefill.connector.unregister_kv_caches()
        prefill.connector.unregister_kv_caches()  # idempotent
        with p_side.client() as c:
            assert c.identity().generation == -1
        # The hold went with the registration: its blocks are freed at the next step.
        assert prefill.step(StepOrders()) == ({"r1"}, None)

        # Asleep, then awake: a pull with the old ticket fails, its blocks are load errors, and
        # nothing outside them is written (the READ goes out while the claim is in flight, so
        # it may have written the blocks it reports invalid; proto/README).
        before = [a.copy() for a in decode.arrays()]
        assert _pull(sched, decode, "d1", old, [7, 8, 9]) == ({"d1"}, {7, 8, 9})
        prefill.connector.restore_kv_caches()
        prefill.connector.restore_kv_caches()  # idempotent
        with p_side.client() as c:
            assert c.identity().generation == registered + 1
        assert _pull(sched, decode, "d2", old, [10, 11, 12]) == ({"d2"}, {10, 11, 12})
        assert changed_outside(before, decode.arrays(), decode.manifest,
                               [[7, 8, 9, 10, 11, 12]]) == 0  # fmt: skip
        before = [a.copy() for a in decode.arrays()]

        # The worker tells the scheduler its generation moved; the next ticket names the new one.
        meta = prefill.connector.build_connector_worker_meta()
        sched.stale(meta.stale_ranks)
        new = _finished(sched, "r2", [4, 5, 6])
        assert new["remote_registration_generation"] == registered + 1
        pattern.write_pattern(prefill.manifest, prefill.arrays(), [[4, 5, 6]], seed=6)
        assert prefill.step(sched.take_orders()) == (None, None)
        assert _pull(sched, decode, "d3", new, [13, 14, 15]) == ({"d3"}, set())
        assert pattern.verify_pattern(decode.manifest, decode.arrays(), [[13, 14, 15]],
                                      seed=6) is None  # fmt: skip
        assert changed_outside(before, decode.arrays(), decode.manifest, [[13, 14, 15]]) == 0
        sending = wait_until(lambda: prefill.step(StepOrders())[0], 30, "hold release")
        assert sending == {"r2"}


def test_sleep_waits_for_a_decode_that_claimed_a_hold_before_letting_the_memory_go(
    engines, tmp_path
):
    """A decode that claimed a hold may still READ it: the sidecar keeps the memory (and the
    hold) until its claim ends, and sleep waits for that (bounded) rather than going on."""
    with _claimed_hold(engines, tmp_path) as (prefill, p_side, sched):
        prefill.connector.unregister_kv_caches()  # returns once the claim ended
        with p_side.client() as c:
            assert c.identity().generation == -1
        assert prefill.step(StepOrders()) == ({"r1"}, None)  # freed once nobody may read them


@pytest.mark.parametrize("heard", ["answer", "no-answer"])
def test_an_unregister_behind_the_engine_frees_no_block_a_decode_may_still_read(
    engines, tmp_path, heard
):
    """An operator unregisters the sidecar behind a running engine while a decode holds a claim.
    While that unregister waits for the READ, the worker's feed calls are refused ("the engine
    is unregistering"): it keeps the hold's blocks rather than taking the sidecar for restarted.
    They are freed when the feed releases the hold (its claim ended); a later unregister then
    succeeds, and the next refused call has the worker register again. So too when the worker
    never heard its registration's generation (that register's answer was lost)."""
    with _claimed_hold(engines, tmp_path) as (prefill, p_side, sched):
        registered = prefill.connector._worker.generation
        if heard == "no-answer":
            prefill.connector._worker.generation += 7

        def unregister_behind() -> None:
            with p_side.client() as c:
                c.unregister(registered)

        def leaving() -> bool:
            with p_side.client() as c:
                try:
                    c.released(0)
                except NotRegisteredError as exc:
                    return "unregistering" in str(exc)
            return False

        with ThreadPoolExecutor(1) as pool:
            behind = pool.submit(unregister_behind)
            wait_until(leaving, 30, "the operator's unregister to start")
            assert prefill.step(StepOrders()) == (None, None)  # a decode may still READ them
            with pytest.raises(MemoryInUseError):  # the claim outlasts the unregister's wait
                behind.result(timeout=60)
        assert prefill.step(StepOrders()) == (None, None)  # still claimed
        sending = wait_until(lambda: prefill.step(StepOrders())[0], 30, "the claim to end")
        assert sending == {"r1"}

        unregister_behind()  # nothing is claimed now: the memory goes at once
        _finished(sched, "r2", [4, 5, 6])
        # Its hold is refused (nothing registered): freed at once, and the worker registers again.
        assert prefill.step(sched.take_orders()) == ({"r2"}, None)
        with p_side.client() as c:
            assert c.identity().generation == registered + 1


def test_a_rank_whose_sidecar_another_rank_registered_refuses_to_take_it_over(engines, tmp_path):
    """Ranks sharing one socket (``sidecar_socket`` without ``{rank}``): the second used to
    unregister the first's live memory to register its own."""
    engine = engines("dense", "LBHNC", num_blocks=24, tp_size=2)
    with worker_pair(tmp_path, "LBHNC", engine) as (first, _, p_side):
        with p_side.client() as c:
            before = c.identity()
        taken = f"sidecar at {p_side.socket} is registered by TP rank 0, not this rank 1: "
        with pytest.raises(ConfigError, match="^" + re.escape(taken) + "each rank needs its own"):
            Rank(engine, "LBHNC", p_side, tp_rank=1)
        with p_side.client() as c:
            after = c.identity()
        assert (after.generation, after.tp_rank) == (before.generation, 0)
        assert first.step(StepOrders()) == (None, None)  # still registered: not refused


def test_an_engine_refuses_at_start_a_sidecar_of_another_protocol(engines, tmp_path, monkeypatch):
    """The engine and sidecar images carry kvxferd separately; a connector whose protocol
    differs from its sidecar's says so at start, naming both releases, and touches nothing."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (_prefill, _decode, p_side):
        with p_side.client() as c:
            before = c.identity()
        ours = before.engine_api_version + 1
        monkeypatch.setattr(worker_module, "ENGINE_API_VERSION", ours)
        said = (f"sidecar at {p_side.socket} speaks engine API {ours - 1} (kvxferd "
                f"{kvxferd.__version__}), this connector {ours} (kvxferd {kvxferd.__version__}): "
                "run one kvxferd release in the engine and sidecar images")  # fmt: skip
        with pytest.raises(ConfigError, match="^" + re.escape(said) + "$"):
            Rank(engine, "LBHNC", p_side)
        with p_side.client() as c:
            assert c.identity() == before  # the running engine's registration, untouched


def test_a_second_engine_given_a_running_engines_sidecar_is_refused_at_start(engines, tmp_path):
    """Two engines of TP rank 0 given one sidecar (two deployments configured alike): the
    second would replace the first's registration, as a restarted engine does. The first holds
    the sidecar's engine lock for its life, so the second stops at start naming it; once the
    first has gone (a restart), the lock is free."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (first, _decode, p_side):
        with p_side.client() as c:
            before = c.identity()
        taken = f"sidecar_socket: {p_side.socket} is in use by another engine (pid {os.getpid()})"
        with pytest.raises(PathInUseError, match="^" + re.escape(taken) + "$"):
            Rank(engine, "LBHNC", p_side)
        with p_side.client() as c:
            assert c.identity() == before  # the first's registration, untouched
        assert first.step(StepOrders()) == (None, None)
        first.close()
        Rank(engine, "LBHNC", p_side).close()  # the next engine on this sidecar starts


def test_an_engine_whose_sidecar_another_engine_took_never_touches_that_engines_memory(
    engines, tmp_path, caplog, monkeypatch
):
    """A second engine that could not take the sidecar's engine lock (it may not write beside
    the socket) replaces the first's registration, as a restarted engine does. The first's
    block ids would now mean the second's memory. Its holds and pulls name its own registration
    and are refused: it neither serves nor writes the second's blocks, a decode reading its
    ticket fails (load errors), what it held is freed, it says why once, and it leaves the
    sidecar alone."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (first, decode, p_side):
        sched = _scheduler(p_side)
        _finished(sched, "r1", [1, 2, 3])
        registered = first.connector._worker.generation
        assert first.step(sched.take_orders()) == (None, None)  # held on the first's memory

        def unwritable(lock: str, field: str, in_use: str) -> int:
            raise ConfigError(f"{field}: cannot open {lock}: Permission denied")

        monkeypatch.setattr(worker_module, "hold_lock", unwritable)
        second = Rank(engine, "LBHNC", p_side)
        try:
            with p_side.client() as c:
                taken = c.identity()
            assert taken.generation == registered + 1
            assert taken.instance == second.connector._worker.instance
            assert taken.instance != first.connector._worker.instance
            sched.stale({0})  # its tickets name the sidecar's registration as it is now
            theirs = [a.copy() for a in second.arrays()]
            mine_before = [a.copy() for a in decode.arrays()]
            caplog.set_level("INFO", logger="kvxferd.vllm.worker")
            params = _finished(sched, "r2", [1, 2, 3])  # the second's blocks 1-3 are live
            assert params["remote_registration_generation"] == registered + 1
            pattern.write_pattern(first.manifest, first.arrays(), [[1, 2, 3]], seed=8)
            # Refused (it names its own generation): r1 went with its registration, r2 never held.
            assert first.step(sched.take_orders()) == ({"r1", "r2"}, None)
            assert _pull(sched, decode, "d2", params, [7, 8, 9]) == ({"d2"}, {7, 8, 9})
            assert changed_outside(mine_before, decode.arrays(), decode.manifest,
                                   [[7, 8, 9]]) == 0  # fmt: skip
            for _ in range(3):  # asked at every step, told once
                _finished(sched, "r3", [4, 5, 6])
                assert first.step(sched.take_orders()) == ({"r3"}, None)
            for now, then in zip(second.arrays(), theirs, strict=True):
                assert (now == then).all()
            with p_side.client() as c:
                assert c.identity() == taken  # not taken back
            told = [r for r in caplog.records if "registered by another engine" in r.message]
            assert len(told) == 1 and told[0].levelname == "ERROR"
            first.connector.unregister_kv_caches()  # vLLM's sleep, then wake-up:
            first.connector.restore_kv_caches()
            with p_side.client() as c:
                assert c.identity() == taken  # still not taken back
        finally:
            second.close()


def test_an_engine_that_gave_its_sidecar_up_stays_off_it_after_the_sidecar_restarts(
    engines, tmp_path, monkeypatch
):
    """After a sidecar restart the engine that took the sidecar registers there first. The first
    forgot its generation when it gave the sidecar up (and the new sidecar process numbers its
    registrations from a random start, so no number it kept would match), so its calls are
    still refused:
    its hold is never placed on the other engine's memory, a decode reading its ticket fails,
    and it does not take the restarted sidecar from the engine registered there."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (first, decode, p_side):

        def unwritable(lock: str, field: str, in_use: str) -> int:
            raise ConfigError(f"{field}: cannot open {lock}: Permission denied")

        monkeypatch.setattr(worker_module, "hold_lock", unwritable)
        second = Rank(engine, "LBHNC", p_side)  # takes the sidecar: the next generation
        restarted = None
        try:
            sched = _scheduler(p_side)
            sched.stale({0})
            _finished(sched, "r1", [1, 2, 3])
            assert first.step(sched.take_orders()) == ({"r1"}, None)  # refused: gave it up
            assert first.connector._worker.generation == -1

            p_side.stop()  # the sidecar restarts; the second engine registers there first
            restarted = start_sidecars(str(tmp_path), ["p"])[0]
            second.connector._worker._recover()  # (what its next refused call does)
            with restarted.client() as c:
                taken = c.identity()
            assert taken.generation >= 0 and taken.instance == second.connector._worker.instance

            sched = _scheduler(restarted)
            sched.stale({0})
            theirs = [a.copy() for a in second.arrays()]
            params = _finished(sched, "r2", [1, 2, 3])  # a ticket for the second's registration
            pattern.write_pattern(first.manifest, first.arrays(), [[1, 2, 3]], seed=8)
            assert first.step(sched.take_orders()) == ({"r2"}, None)  # refused, not held
            assert _pull(sched, decode, "d2", params, [7, 8, 9]) == ({"d2"}, {7, 8, 9})
            for now, then in zip(second.arrays(), theirs, strict=True):
                assert (now == then).all()
            with restarted.client() as c:
                assert c.identity() == taken  # left to the engine registered there
        finally:
            second.close()
            if restarted is not None:
                restarted.stop()


def test_an_engine_that_never_heard_its_registrations_generation_adopts_it(engines, tmp_path):
    """Its register's answer was lost: its calls name an older generation and are refused. The
    registration is its own (its instance), so it takes that generation and goes on, without
    registering again."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, _decode, p_side):
        worker = prefill.connector._worker
        registered = worker.generation
        worker.generation += 7  # as if the answer naming its generation never came
        sched = _scheduler(p_side)
        _finished(sched, "r1", [1, 2, 3])
        assert prefill.step(sched.take_orders()) == ({"r1"}, None)  # refused: freed
        assert worker.generation == registered
        _finished(sched, "r2", [4, 5, 6])
        assert prefill.step(sched.take_orders()) == (None, None)  # held
        with p_side.client() as c:
            assert c.identity().generation == registered
