"""The connector consults the kvxferd store (issue 12): vLLM's real Scheduler and a worker-role
connector beside a real ``kvxferd serve`` save a finished request; after a restart (new
scheduler, new sidecar process, same store directory, fresh memory) the same prompt loads from
the store's files, every byte of every layer of every loaded block is verified, and vLLM
computes only the tail. A corrupt file is a load error that vLLM recomputes; with the store off
no store call reaches the sidecar."""

from __future__ import annotations

import os

import pytest

from kvxferd.store import chunk_keys
from kvxferd.vllm.connector import store_root
from kvxferd.vllm.scheduler import StepOrders
from tests.sidecar.harness import changed_outside, metric
from tests.vllm.ranks import step
from tests.vllm.stores import (
    CHUNK,
    LAYOUT,
    Engine,
    admit_load,
    check_loaded,
    computes_only_the_tail,
)

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("model", ["dense", "nemotron-h"])
def test_a_restarted_engine_loads_a_saved_prompt_and_computes_only_the_tail(
    engines, model, tmp_path, monkeypatch
):
    """Dense: the same prompt again (vLLM recomputes the last token of a full hit). Hybrid: the
    conversation goes on (prompt + its answer): the Mamba state saved after the first request's
    computed tokens is exactly where the hit ends (a state cannot be rewound a token)."""
    engine = engines(model, LAYOUT, num_blocks=32)
    ext = engine.config.kv_transfer_config.kv_connector_extra_config
    monkeypatch.setattr(engine.config.kv_transfer_config, "kv_connector_extra_config", dict(ext))
    prompt = [(7 * i) % 1000 + 1 for i in range(300)]
    hybrid = model != "dense"
    first = Engine(engine, tmp_path, "first")
    try:
        saves = first.run("r1", prompt, max_tokens=2 if hybrid else 1)
    finally:
        first.close()
    assert len(saves) == 1 and saves[0].num_tokens == (301 if hybrid else 300)
    assert os.listdir(tmp_path / "store")

    second = Engine(engine, tmp_path, "second")  # new sidecar process, new memory, new scheduler
    try:
        again = prompt + [7, 7] if hybrid else prompt  # the step helper samples token 7
        load, before, answer = admit_load(second, "r2", again)
        assert load.num_tokens == saves[0].num_tokens and not load.error
        assert answer == (None, {"r2"})
        check_loaded(second, load, load.num_tokens, before)
        assert metric(second.sidecar.peer, "kvxferd_store_loads_total", outcome="done") == 1
        computes_only_the_tail(second, "r2")
    finally:
        second.close()


def test_a_prompt_saved_at_tp2_loads_at_tp1(engines, tmp_path, monkeypatch):
    """Both ranks of a TP-2 engine save their heads beside each other; a TP-1 engine after it
    finds every head of every chunk in the shared directory and loads them all."""
    prompt = [(3 * i) % 900 + 1 for i in range(250)]
    engine = engines("dense", LAYOUT, num_blocks=32, tp_size=2)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config", dict(cfg.kv_connector_extra_config))
    first = Engine(engine, tmp_path, "tp2")
    try:
        assert [s.num_tokens for s in first.run("r1", prompt)] == [250]
    finally:
        first.close()
    engine = engines("dense", LAYOUT, num_blocks=32)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config", dict(cfg.kv_connector_extra_config))
    second = Engine(engine, tmp_path, "tp1")
    try:
        load, before, answer = admit_load(second, "r2", prompt)
        assert load.num_tokens == 250 and answer == (None, {"r2"})
        check_loaded(second, load, 250, before)
        computes_only_the_tail(second, "r2")
    finally:
        second.close()


@pytest.mark.parametrize("model", ["dense", "nemotron-h"])
def test_a_corrupt_store_file_is_a_load_error_and_vllm_recomputes(
    engines, tmp_path, monkeypatch, model
):
    """A hybrid model's block ids are per group, so its failed load names the request
    (``failed_recving``) instead of blocks vLLM could not map back to it."""
    from vllm.v1.outputs import KVConnectorOutput

    engine = engines(model, LAYOUT, num_blocks=32)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config", dict(cfg.kv_connector_extra_config))
    monkeypatch.setattr(cfg, "kv_load_failure_policy", "recompute")
    prompt = list(range(11, 311))
    hybrid = model != "dense"  # saves the state after its answer: the next turn can load it
    first = Engine(engine, tmp_path, "first")
    try:
        first.run("r1", prompt, max_tokens=2 if hybrid else 1)
    finally:
        first.close()
    store_dir = tmp_path / "store"
    files = sorted(p for p in store_dir.rglob("*") if p.is_file())
    assert files
    # The first chunk's entry: after its load fails nothing of the prompt is left in the store,
    # so vLLM computes it all (a later chunk's corruption leaves the chunks before it, which a
    # second lookup finds and loads). Keys are salted with the engine's setup (the same root).
    first_key = chunk_keys(prompt, CHUNK, store_root(engine.config))[0]
    victim = next(p for p in files if p.name.startswith(first_key))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # a payload byte: its section checksum no longer matches
    victim.write_bytes(bytes(data))

    second = Engine(engine, tmp_path, "second")
    try:
        again = prompt + [7, 7] if hybrid else prompt  # the step helper samples token 7
        load, (before, *_), answer = admit_load(second, "r2", again)
        assert answer == (None, {"r2"})  # finished, with errors
        bad = second.rank.connector.get_block_ids_with_load_errors()
        failed = second.rank.failed
        if hybrid:
            assert (bad, failed) == (set(), {"r2"})
        else:
            assert (bad, failed) == ({b for g in load.block_ids for b in g}, set())
        rank = second.rank
        assert changed_outside(before, rank.arrays(), rank.manifest, load.block_ids) == 0
        assert metric(second.sidecar.peer, "kvxferd_store_loads_total", outcome="failed") == 1
        output = KVConnectorOutput(
            finished_recving={"r2"}, invalid_block_ids=bad, failed_recving=set(failed)
        )
        step(second.sched, output)
        out, _ = step(second.sched)
        assert out.num_scheduled_tokens.get("r2", 0) == len(again)  # computed from scratch
        assert out.kv_connector_metadata.orders.loads == []
    finally:
        second.close()


def test_with_the_store_off_no_store_call_reaches_the_sidecar(engines, tmp_path, monkeypatch):
    engine = engines("dense", LAYOUT, num_blocks=32)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config", dict(cfg.kv_connector_extra_config))
    eng = Engine(engine, tmp_path, "off", store="off")
    try:
        assert eng.sched.connector._sched.store is None
        assert eng.run("r1", list(range(1, 301))) == []
        assert eng.run("r2", list(range(1, 301))) == []  # no lookup, no load either
        peer = eng.sidecar.peer
        for result in ("hit", "miss"):
            assert metric(peer, "kvxferd_store_lookup_tokens_total", result=result) == 0
        for outcome in ("done", "failed"):
            assert metric(peer, "kvxferd_store_loads_total", outcome=outcome) == 0
        assert not any((tmp_path / "store").rglob("*.*"))  # nothing saved
        assert eng.rank.step(StepOrders()) == (None, None)
    finally:
        eng.close()
