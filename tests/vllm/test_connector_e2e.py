"""The real vLLM Scheduler and worker-role connectors, each rank beside a real ``kvxferd serve``:
an aborted decode releases the prefill's hold at once (``declined``), without holding up the
decode's engine step while the prefill does not answer, and a ticket minted for a
sidecar that has since re-registered is given up at once and makes the scheduler re-read the
sidecar's identity; a sidecar restarted beside a running engine gets the engine registered
again and whatever the old one held is freed."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kvxferd.vllm.scheduler import StepOrders
from tests.sidecar.harness import TOKEN, ReleasedFeed, start_sidecars, wait_until
from tests.vllm.ranks import Rank, request, step

pytestmark = pytest.mark.nixl

N = 300


def _scheduler(engine):
    """vLLM's v1 Scheduler for ``engine`` (its connector reads the sidecar socket set last)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=engine.config,
        kv_cache_config=engine.kv_cache_config,
        structured_output_manager=StructuredOutputManager(engine.config),
        block_size=engine.config.cache_config.block_size,
    )


def _prefill(sched, rank: Rank, rid: str) -> dict:
    """Run a prefill request to its end; its worker places the hold. Its params."""
    sched.add_request(request(rid, N, {"do_remote_decode": True}))
    out, engine_out = step(sched)
    params = next(
        o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
        if o.kv_transfer_params
    )  # fmt: skip
    rank.step(out.kv_connector_metadata.orders)
    out, _ = step(sched)  # the hold minted when the request finished rides in this step
    rank.step(out.kv_connector_metadata.orders)
    return params


@pytest.fixture
def pair(engines, tmp_path, monkeypatch):
    """(engine, prefill sidecar, decode sidecar, prefill rank, decode rank), closed after."""
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    engine = engines("dense", "LBHNC", num_blocks=24)
    p_side, d_side = start_sidecars(str(tmp_path), ["p", "d"])
    ranks = []
    try:
        ranks.append(Rank(engine, "LBHNC", p_side))
        ranks.append(Rank(engine, "LBHNC", d_side))
        yield engine, p_side, d_side, ranks[0], ranks[1]
    finally:
        for rank in ranks:
            rank.close()
        p_side.stop()
        d_side.stop()


def test_an_aborted_decode_releases_the_prefill_hold_at_once(pair):
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    engine, p_side, d_side, prefill, decode = pair
    feed = ReleasedFeed(p_side)
    ext = engine.config.kv_transfer_config.kv_connector_extra_config
    ext["sidecar_socket"] = p_side.socket
    p_sched = _scheduler(engine)
    params = _prefill(p_sched, prefill, "p1")
    hold_id = params["kvxferd_tickets"][0]["hold_id"]
    assert feed.poll() == []  # held: nothing released yet

    ext["sidecar_socket"] = d_side.socket
    d_sched = _scheduler(engine)
    d_sched.add_request(request("d1", N, dict(params)))
    d_sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    out, _ = step(d_sched)
    assert decode.step(out.kv_connector_metadata.orders) == (None, None)

    # The decline (sent from the worker's outbox) releases the hold at once (its lease is 30 s).
    assert feed.wait_for(hold_id) == {hold_id: "declined"}
    sending = wait_until(lambda: prefill.step(StepOrders())[0], 10, "the prefill's release")
    assert sending == {"p1"}
    free = p_sched.kv_cache_manager.block_pool.get_num_free_blocks()
    step(p_sched, KVConnectorOutput(finished_sending=sending))
    assert p_sched.kv_cache_manager.block_pool.get_num_free_blocks() > free


def test_a_decline_to_a_prefill_that_does_not_answer_does_not_hold_up_the_decode_step(
    engines, tmp_path, monkeypatch
):
    from vllm.v1.request import RequestStatus

    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    engine = engines("dense", "LBHNC", num_blocks=24)
    # The decode sidecar waits up to a minute for a prefill's answer.
    sides = start_sidecars(str(tmp_path), ["p", "d"], env={"KVXFERD_HANDSHAKE_TIMEOUT_S": "60"})
    p_side, d_side = sides
    ranks: list[Rank] = []
    try:
        ranks.append(Rank(engine, "LBHNC", p_side))
        ranks.append(Rank(engine, "LBHNC", d_side))
        prefill, decode = ranks
        feed = ReleasedFeed(p_side)
        ext = engine.config.kv_transfer_config.kv_connector_extra_config
        ext["sidecar_socket"] = p_side.socket
        params = _prefill(_scheduler(engine), prefill, "p1")
        hold_id = params["kvxferd_tickets"][0]["hold_id"]

        ext["sidecar_socket"] = d_side.socket
        d_sched = _scheduler(engine)
        d_sched.add_request(request("d1", N, dict(params)))
        d_sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        out, _ = step(d_sched)
        os.kill(p_side.child.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            stepped = threading.Thread(
                target=decode.step, args=(out.kv_connector_metadata.orders,), daemon=True
            )
            stepped.start()
            stepped.join(20)  # the decline waits up to 60 s for the prefill; the step does not
            assert not stepped.is_alive()
        finally:
            os.kill(p_side.child.pid, signal.SIGCONT)
        # The decline was sent all the same, from the worker's outbox: released once answered.
        assert feed.wait_for(hold_id) == {hold_id: "declined"}
    finally:
        for rank in ranks:
            rank.close()
        p_side.stop()
        d_side.stop()


def test_a_stale_ticket_frees_its_blocks_and_the_scheduler_rereads_the_identity(pair):
    from vllm.v1.outputs import KVConnectorOutput

    engine, p_side, _d_side, prefill, _decode = pair
    feed = ReleasedFeed(p_side)
    engine.config.kv_transfer_config.kv_connector_extra_config["sidecar_socket"] = p_side.socket
    p_sched = _scheduler(engine)
    first = _prefill(p_sched, prefill, "p1")
    worker = prefill.connector._worker
    registered = worker.generation
    assert first["kvxferd_tickets"][0]["generation"] == registered >= 0
    heads = engine.config.model_config.get_total_num_kv_heads()
    worker.register(prefill.views, engine.kv_cache_config, heads)  # the engine re-registers
    assert worker.generation == registered + 1
    worker.take_stale()  # lose the registration's own signal: the hold must catch it

    p_sched.add_request(request("p2", N, {"do_remote_decode": True}))
    out, engine_out = step(p_sched)
    stale = next(o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
                 if o.kv_transfer_params)  # fmt: skip
    assert stale["kvxferd_tickets"][0]["generation"] == registered  # from the old identity
    prefill.step(out.kv_connector_metadata.orders)
    out, _ = step(p_sched)
    sending, _ = prefill.step(out.kv_connector_metadata.orders)
    assert sending == {"p2"}  # no claim can match the ticket: freed at once
    hold_id = stale["kvxferd_tickets"][0]["hold_id"]
    assert feed.wait_for(hold_id, timeout_s=10)[hold_id] == "aborted"
    meta = prefill.connector.build_connector_worker_meta()
    assert meta is not None and meta.stale_ranks == {0}
    step(p_sched, KVConnectorOutput(finished_sending=sending, kv_connector_worker_meta=meta))

    fresh = _prefill(p_sched, prefill, "p3")
    assert fresh["kvxferd_tickets"][0]["generation"] == registered + 1


def test_a_sidecar_restarted_beside_a_running_engine_is_registered_again(engines, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    from vllm.v1.outputs import KVConnectorOutput

    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    engine = engines("dense", "LBHNC", num_blocks=24)
    p_side = start_sidecars(str(tmp_path), ["p"])[0]
    prefill = None
    try:
        prefill = Rank(engine, "LBHNC", p_side)
        p_sched = _scheduler(engine)
        first = _prefill(p_sched, prefill, "p1")
        old_epoch = first["kvxferd_tickets"][0]["epoch"]
        prefill.connector._worker.take_stale()  # the registration's own signal, consumed

        p_side.stop()  # the sidecar restarts on the same socket; the engine keeps running
        p_side = start_sidecars(str(tmp_path), ["p"])[0]
        with p_side.client() as c:
            assert c.identity().generation == -1
        p_sched.add_request(request("p2", N, {"do_remote_decode": True}))
        out, engine_out = step(p_sched)
        second = next(o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs
                      if o.kv_transfer_params)  # fmt: skip
        assert second["kvxferd_tickets"][0]["epoch"] == old_epoch  # minted before anyone knew
        # The released feed answers "no engine": registered again, p1's hold is gone: freed.
        assert prefill.step(out.kv_connector_metadata.orders) == ({"p1"}, None)
        with p_side.client() as c:
            ident = c.identity()
        assert ident.generation >= 0 and ident.epoch != old_epoch
        out, _ = step(p_sched)
        feed = ReleasedFeed(p_side)
        # p2's ticket names the old epoch: no claim can match it, so its hold is given up.
        sending, _ = prefill.step(out.kv_connector_metadata.orders)
        assert sending == {"p2"}
        assert [r for _h, r in feed.poll()] == ["aborted"]
        meta = prefill.connector.build_connector_worker_meta()
        assert meta is not None and meta.stale_ranks == {0}
        done = KVConnectorOutput(finished_sending={"p1", "p2"}, kv_connector_worker_meta=meta)
        step(p_sched, done)

        third = _prefill(p_sched, prefill, "p3")
        assert third["kvxferd_tickets"][0]["epoch"] == ident.epoch
        assert feed.poll() == []  # held by the new sidecar
        assert prefill.step(StepOrders()) == (None, None)
    finally:
        if prefill is not None:
            prefill.close()
        p_side.stop()


def _pull_orders(pair) -> StepOrders:
    """Request p1 prefilled, then d1 scheduled on the decode with p1's params: the step's
    orders, which pull d1 (not run yet)."""
    engine, p_side, d_side, prefill, _decode = pair
    ext = engine.config.kv_transfer_config.kv_connector_extra_config
    ext["sidecar_socket"] = p_side.socket
    params = _prefill(_scheduler(engine), prefill, "p1")
    ext["sidecar_socket"] = d_side.socket
    d_sched = _scheduler(engine)
    d_sched.add_request(request("d1", N, dict(params)))
    out, _ = step(d_sched)
    orders = out.kv_connector_metadata.orders
    assert [p.request_id for p in orders.pulls] == ["d1"]
    return orders


def test_a_pull_whose_start_got_no_answer_is_not_reported_failed_while_it_may_run(pair):
    """A pull call that timed out may have started at the sidecar, whose READ then writes the
    request's blocks: reporting it failed at once would have vLLM recompute (or, aborted, reuse)
    them under that READ. It is reported once the finished-pulls feed says how it ended."""
    from kvxferd.client import EngineClient, frames_available

    engine, p_side, d_side, prefill, decode = pair
    orders = _pull_orders(pair)
    worker = decode.connector._worker
    # A short timeout for the test's sake (30 s in an engine) makes the pull call go unanswered.
    short = EngineClient(d_side.socket, timeout_s=0.5, frames=frames_available(d_side.socket))
    kept, worker.client.client = worker.client.client, short
    try:
        os.kill(d_side.child.pid, signal.SIGSTOP)
        try:
            assert decode.step(orders) == (None, None)  # not reported while it may run
        finally:
            os.kill(d_side.child.pid, signal.SIGCONT)
        assert decode.connector.get_block_ids_with_load_errors() == set()
        worker.client.client = kept
        # The sidecar got the pull all the same and runs it: its feed says it is done.
        recving = wait_until(lambda: decode.step(StepOrders())[1], 60, "the pull's end")
        assert recving == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == set()
        assert worker._pulls == {}
    finally:
        worker.client.client = kept
        short.close()


def test_a_pull_to_a_sidecar_that_is_gone_is_reported_failed_at_once(pair):
    """A pull that could not even connect was never sent: nothing can write its blocks, so it
    is reported ended with every block a load error in that step (vLLM recomputes them now,
    not after waiting out a pull that may be running)."""
    engine, p_side, d_side, prefill, decode = pair
    orders = _pull_orders(pair)
    (pull,) = orders.pulls
    d_side.stop()  # the decode's sidecar has gone: the pull call cannot connect
    assert decode.step(orders) == (None, {"d1"})
    errors = decode.connector.get_block_ids_with_load_errors()
    assert errors == {b for g in pull.block_ids for b in g if b >= 0} and errors
    assert decode.connector._worker._pulls == {}
