"""Whose registration a sidecar has, through the real worker glue: an engine that starts while the
sidecar still sets up another register waits for it (bounded) and then decides as at any start;
a registration that names no instance (a tool's, the simulator's) is another engine's, never
waited for nor taken over."""

from __future__ import annotations

import functools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvxferd.client import EngineClient
from kvxferd.errors import AlreadyRegisteredError
from kvxferd.vllm import worker as worker_module
from kvxferd.vllm.scheduler import SchedulerSide
from tests.sidecar.harness import EnginePool, plan, start_sidecar, wait_until
from tests.vllm.heldregister import HELD, gate, start_held_sidecar
from tests.vllm.ranks import Rank, finish, prefill_side

pytestmark = pytest.mark.nixl
N = 300  # tokens: three 128-token blocks


def _scheduler(socket: str) -> SchedulerSide:
    """The prefill's scheduler side, reading its one rank's identity from the sidecar at
    ``socket`` (whichever process serves it now)."""

    def identities():
        with EngineClient(socket) as c:
            return [c.identity()]

    return prefill_side(identities, 128)


def _held(sched: SchedulerSide, rank: Rank, rid: str, ids: list[int]) -> tuple:
    """The prefill finishes ``rid`` on blocks ``ids`` and ``rank`` steps: its finished sets."""
    delay, _ = finish(sched, rid, [ids], N)
    assert delay
    return rank.step(sched.take_orders())


def test_an_engine_that_starts_while_another_register_is_in_progress_waits_for_it(
    engines, tmp_path, caplog, monkeypatch
):
    """An engine restarted just after its predecessor died mid-register: the sidecar still sets
    that register up and refuses this one (409, "in progress"). The engine tries again, bounded,
    reading the identity afresh each time: once the predecessor's registration is in, it
    replaces it as a restarted engine does, and serves. Past the bound it fails naming the
    sidecar."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    gate_path = str(tmp_path / "gate")
    side = start_held_sidecar(str(tmp_path), "p", gate_path)
    predecessor = EnginePool(plan("llama-3.1-8b", num_blocks=8))
    rank = None

    def register_predecessor():
        with side.client() as c:
            return c.register(predecessor.manifest, predecessor.specs(), instance="predecessor")

    def refused_in_progress() -> bool:
        return any("register is in progress" in r.getMessage() for r in caplog.records)

    try:
        with ThreadPoolExecutor(2) as pool, gate(gate_path):
            theirs = pool.submit(register_predecessor)
            side.child.wait_line(HELD, 30)  # the sidecar counts it in progress from here

            monkeypatch.setattr(worker_module, "_REGISTER_WAIT_S", 0.0)
            said = (f"sidecar at {side.socket}: another engine's register was still in progress "
                    "after 0 s")  # fmt: skip
            with pytest.raises(AlreadyRegisteredError, match="^" + re.escape(said)):
                Rank(engine, "LBHNC", side)  # (a rank that fails lets its lock go)
            monkeypatch.undo()

            caplog.set_level("INFO", logger="kvxferd.vllm.worker")
            starting = pool.submit(Rank, engine, "LBHNC", side)
            # (A start that failed at once is done: its error is raised below.)
            wait_until(lambda: refused_in_progress() or starting.done(), 30,
                       "the engine's register to be refused")  # fmt: skip
        # The gate is open: the predecessor's register ends, and the engine's goes through.
        previous = theirs.result(timeout=60).generation
        rank = starting.result(timeout=60)
        with side.client() as c:
            ident = c.identity()
        assert (ident.generation, ident.instance) == (previous + 1,
                                                      rank.connector._worker.instance)  # fmt: skip
        assert _held(_scheduler(side.socket), rank, "r1", [1, 2, 3]) == (None, None)
    finally:
        if rank is not None:
            rank.close()
        side.stop()
        predecessor.close()


@pytest.mark.parametrize("behind", ["unregistered", "restarted"])
def test_a_registration_that_names_no_instance_is_another_engines(
    engines, tmp_path, caplog, behind
):
    """A tool or the simulator registers without an instance, after an operator unregistered the
    running engine, or after its sidecar restarted (the engine, woken from sleep once, named
    generation 1). The engine's calls are refused; it does not wait for that registration to
    go (nothing would end it), nor take the sidecar from it: it gives up what it held, says why
    once, and leaves the sidecar alone, also when vLLM wakes it from sleep."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    tool = EnginePool(plan("llama-3.1-8b", num_blocks=8))
    side = start_sidecar(str(tmp_path), "p")
    first = None
    try:
        first = Rank(engine, "LBHNC", side)
        if behind == "restarted":
            first.connector.unregister_kv_caches()  # vLLM's sleep and wake-up: generation 1
            first.connector.restore_kv_caches()
        sched = _scheduler(side.socket)
        assert _held(sched, first, "r1", [1, 2, 3]) == (None, None)

        if behind == "restarted":
            side.stop()
            side = start_sidecar(str(tmp_path), "p")
        else:
            with side.client() as c:
                c.unregister(c.identity().generation)
        with side.client() as c:
            c.register(tool.manifest, tool.specs())  # no instance
            taken = c.identity()
        assert taken.generation >= 0 and taken.instance == ""

        caplog.set_level("INFO", logger="kvxferd.vllm.worker")
        sched.stale({0})
        # Refused: r1 went with its registration, r2 was never held.
        assert _held(sched, first, "r2", [4, 5, 6]) == ({"r1", "r2"}, None)
        for _ in range(3):  # asked at every step, told once
            assert _held(sched, first, "r3", [7, 8, 9]) == ({"r3"}, None)
        told = [r for r in caplog.records if "registered by another engine" in r.getMessage()]
        assert len(told) == 1 and told[0].levelname == "ERROR"
        with side.client() as c:
            assert c.identity() == taken  # not taken over
        first.connector.unregister_kv_caches()  # vLLM's sleep, then wake-up:
        first.connector.restore_kv_caches()
        with side.client() as c:
            assert c.identity() == taken  # still not taken over
    finally:
        if first is not None:
            first.close()
        side.stop()
        tool.close()


def test_an_engine_whose_register_gets_no_answer_tries_again_and_starts(
    engines, tmp_path, caplog, monkeypatch
):
    """The sidecar sets a register up for longer than the worker's client waits (1 s here, 30 s
    in vLLM): the call gets no answer, yet the sidecar may take it. vLLM's start does not fail:
    the worker tries again (logged), is told the first register is still in progress, then
    finds it in and named by its own instance, replaces it as at any start, and serves."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    gate_path = str(tmp_path / "gate")
    side = start_held_sidecar(str(tmp_path), "p", gate_path)
    short = functools.partial(EngineClient, timeout_s=1.0)  # the worker's client gives up
    monkeypatch.setattr(worker_module, "EngineClient", short)
    caplog.set_level("INFO", logger="kvxferd.vllm.worker")
    rank = None

    def no_answer() -> bool:
        return any("register got no answer" in r.getMessage() for r in caplog.records)

    try:
        with ThreadPoolExecutor(1) as pool:
            with gate(gate_path):
                starting = pool.submit(Rank, engine, "LBHNC", side)
                side.child.wait_line(HELD, 30)  # the register is in, and held
                wait_until(lambda: no_answer() or starting.done(), 30,
                           "the engine's register to get no answer")  # fmt: skip
            rank = starting.result(timeout=60)  # before: SidecarUnreachableError, no answer
        worker = rank.connector._worker
        with side.client() as c:
            ident = c.identity()
        assert (ident.generation, ident.instance) == (worker.generation, worker.instance)
        assert _held(_scheduler(side.socket), rank, "r1", [1, 2, 3]) == (None, None)
    finally:
        if rank is not None:
            rank.close()
        side.stop()
