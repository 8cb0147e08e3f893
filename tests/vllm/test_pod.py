"""A prefill engine of TP 2 whose workers share one pod sidecar (``serve --pod-ranks 2``,
``"pod": true``): vLLM's real Scheduler mints one ticket per request, both workers register and
place each hold, a decode engine (a sidecar per rank) pulls every byte with that one ticket, the
hold is released once; sleep and wake-up of the pod; with the store on, each worker saves and
loads its own rank's blocks through the pod; what is still refused, and why."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import msgspec
import pytest

from kvxferd import pattern
from kvxferd.client import EngineClient
from kvxferd.errors import ConfigError, NotRegisteredError, PathInUseError
from kvxferd.sidecar.tickets import verify_ticket
from kvxferd.store.tiers import parse_filename
from kvxferd.vllm import pdcheck
from kvxferd.vllm import worker as worker_module
from kvxferd.vllm.connector import KvxferdConnector
from kvxferd.vllm.scheduler import StepOrders
from kvxferd.wire import Identity, Ticket
from tests.sidecar.harness import TOKEN, changed_outside, metric, start_sidecars, wait_until
from tests.vllm import stores
from tests.vllm.ranks import Rank, finish, prefill_side, step_until

N = 300  # prompt tokens: three 128-token blocks


def _register_at_once(ranks: list[Rank]) -> None:
    """Every rank's ``register_kv_caches`` at once, as vLLM's workers do (a pod's registers
    answer together)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        for done in [pool.submit(r.register) for r in ranks]:
            done.result(timeout=60)


def _at_once(ranks: list[Rank], method: str) -> None:
    """A connector method on every rank at once (vLLM's sleep and wake-up: collective_rpc)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        for done in [pool.submit(getattr(r.connector, method)) for r in ranks]:
            done.result(timeout=120)


@contextlib.contextmanager
def _pod_engine(engines, monkeypatch, tmp_path, decode_tp: int = 1, prefill_tp: int = 2,
                model: str = "dense"):  # fmt: skip
    """The prefill engine (``model``, TP ``prefill_tp``) beside one pod sidecar, every rank
    registered, and a decode engine of TP ``decode_tp`` with a sidecar per rank: (prefill, its
    ranks, the pod, decode, its ranks)."""
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    p_engine = engines(model, "LBHNC", num_blocks=24, tp_size=prefill_tp)
    # (TP > 1: another config than any prefill's, whose extra config says "pod")
    d_engine = engines(model, "LBHNC", num_blocks=24 if decode_tp == 1 else 32,
                       **({"tp_size": decode_tp} if decode_tp > 1 else {}))  # fmt: skip
    monkeypatch.setitem(p_engine.config.kv_transfer_config.kv_connector_extra_config, "pod", True)
    names = ["pod"] + [f"d{r}" for r in range(decode_tp)]
    (pod,) = start_sidecars(str(tmp_path), names[:1], "--pod-ranks", str(prefill_tp))
    d_sides = start_sidecars(str(tmp_path), names[1:])
    prefill: list[Rank] = []  # (a test may replace its ranks: these are closed at the end)
    decode: list[Rank] = []
    try:
        prefill += [Rank(p_engine, "LBHNC", pod, r, register=False) for r in range(prefill_tp)]
        _register_at_once(prefill)
        decode += [Rank(d_engine, "LBHNC", s, r) for r, s in enumerate(d_sides)]
        yield p_engine, prefill, pod, d_engine, decode
    finally:
        for rank in prefill + decode:
            rank.close()
        for side in [pod, *d_sides]:
            side.stop()


def _same(orders: StepOrders) -> StepOrders:
    """What ``pdcheck._wait_all`` wraps its empty orders in (tests.vllm.ranks.Rank wraps)."""
    return orders


def _step_all(ranks: list[Rank], meta, which: int) -> list[set[str]]:
    """Every rank runs one step's metadata: what each reported finished (``which``)."""
    return [rank.step(meta.orders)[which] or set() for rank in ranks]


@pytest.mark.nixl
@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp"),
    [
        ("dense", 2, 1),
        ("dense", 2, 2),
        ("dense", 4, 1),
        ("dense", 4, 2),
        ("dense", 4, 4),
        ("dense-kv4", 4, 2),
    ],  # fmt: skip
    ids=[
        "tp2-to-tp1",
        "tp2-to-tp2",
        "tp4-to-tp1",
        "tp4-to-tp2",
        "tp4-to-tp4",
        "kv4-tp4-to-tp2",
    ],  # fmt: skip
)
def test_a_tp_n_prefill_sharing_a_pod_sidecar_moves_every_byte_with_one_ticket(
    engines, monkeypatch, tmp_path, model, prefill_tp, decode_tp
):
    """Every worker of a TP N prefill registers its rank on the one pod sidecar and places the
    scheduler's one hold (one ticket, ``ranks`` N); a decode of another TP pulls every byte
    with that ticket, and once the hold is released every prefill worker frees the blocks.
    At TP 4 the dense config's two KV heads are replicated, each on two ranks (vLLM's rule
    when TP exceeds the KV heads): a decode reads each head from one of its replicas; with four
    heads (dense-kv4) each rank has its own, and a decode rank reads two ranks' heads."""
    from vllm.v1.outputs import KVConnectorOutput

    with _pod_engine(engines, monkeypatch, tmp_path, decode_tp, prefill_tp, model) as (
        p_engine, prefill, pod, d_engine, decode,
    ):  # fmt: skip
        none = [set()] * prefill_tp  # what each prefill worker reports finished
        with pod.client() as c:
            ident = c.identity()
        assert ident.pod_ranks == ident.tp_size == prefill_tp and ident.generation >= 0
        gens = {r.connector._worker.generation for r in prefill}
        assert gens == {ident.generation}  # one registration, every rank
        instances = {r.connector._worker.instance for r in prefill}
        assert instances == {ident.instance}  # the engine's workers share one id
        for r in range(prefill_tp):  # an engine lock per rank beside the one socket
            assert os.path.exists(f"{pod.socket}.engine.lock.{r}")

        p_sched, d_sched = pdcheck._scheduler(p_engine), pdcheck._scheduler(d_engine)
        bs = p_engine.config.cache_config.block_size
        tokens = list(range(1, N + 1))
        p_sched.add_request(pdcheck.request("r1", tokens, {"do_remote_decode": True}, bs))
        out, eng_out = pdcheck.step(p_sched)
        (params,) = [o.kv_transfer_params for e in eng_out.values() for o in e.outputs
                     if o.kv_transfer_params]  # fmt: skip
        (ticket,) = params["kvxferd_tickets"]  # the pod's one ticket
        assert ticket["tp_rank"] == 0 and ticket["tp_size"] == ticket["ranks"] == prefill_tp
        assert ticket["peer"] == pod.peer and params["tp_size"] == prefill_tp
        held = [list(g) for g in ticket["block_ids"]]
        for rank in prefill:  # each rank's own bytes (its KV heads)
            pattern.write_pattern(rank.manifest, rank.arrays(), held, seed=41)
        assert _step_all(prefill, out.kv_connector_metadata, 0) == none
        out, _ = pdcheck.step(p_sched)  # the hold rides in this step's orders
        assert [h.hold_id for h in out.kv_connector_metadata.orders.holds] == [ticket["hold_id"]]
        assert _step_all(prefill, out.kv_connector_metadata, 0) == none  # every rank placed it

        d_sched.add_request(pdcheck.request("d1", tokens, dict(params), bs))
        out, _ = pdcheck.step(d_sched)
        (pull,) = out.kv_connector_metadata.orders.pulls
        assert len(pull.tickets) == 1
        before = [[a.copy() for a in r.arrays()] for r in decode]
        started = [r.step(out.kv_connector_metadata.orders) for r in decode]
        deadline = time.monotonic() + 60
        recv = pdcheck._wait_all(decode, 1, _same, deadline, started)
        assert recv == {"d1"}
        for r, was in zip(decode, before, strict=True):
            assert r.connector.get_block_ids_with_load_errors() == set() and not r.failed
            assert pattern.verify_pattern(r.manifest, r.arrays(), pull.block_ids, 41) is None
            assert changed_outside(was, r.arrays(), r.manifest, pull.block_ids) == 0
        pdcheck.step(d_sched, KVConnectorOutput(finished_recving=recv))

        # Released once: each worker reads it in its own cursor of the one feed, once, and
        # reports the request's blocks free (vLLM frees them once every worker has).
        sending = pdcheck._wait_all(prefill, 0, _same, time.monotonic() + 30)
        assert sending == {"r1"}
        with pod.client() as c:
            released = c.released(0).holds
        assert [h.hold_id for h in released] == [ticket["hold_id"]]
        assert _step_all(prefill, out.kv_connector_metadata, 0) == none
        free = p_sched.kv_cache_manager.block_pool.get_num_free_blocks()
        pdcheck.step(p_sched, KVConnectorOutput(finished_sending=sending))
        assert p_sched.kv_cache_manager.block_pool.get_num_free_blocks() > free  # vLLM freed them
        assert "r1" not in p_sched.requests


@pytest.mark.nixl
def test_a_pods_sleep_ends_its_registration_once_and_wake_up_moves_new_requests(
    engines, monkeypatch, tmp_path
):
    """Sleep: both workers unregister at once; the pod goes once, its hold with it (each worker
    frees the blocks). Wake-up: both register again under one new generation; the scheduler's
    next ticket names it and a decode pulls it byte-exact."""
    with _pod_engine(engines, monkeypatch, tmp_path) as (_pe, prefill, pod, _de, (decode,)):
        with pod.client() as c:
            registered = c.identity().generation

        def identities():
            with pod.client() as c:
                return [c.identity()]

        sched = prefill_side(identities, 128, tp_size=2, pod=True)
        _delay, old = finish(sched, "r1", [[1, 2, 3]], N)
        (ticket,) = old["kvxferd_tickets"]
        assert ticket["ranks"] == 2
        orders = sched.take_orders()
        assert [r.step(orders) for r in prefill] == [(None, None)] * 2  # both placed

        _at_once(prefill, "unregister_kv_caches")
        with pod.client() as c:
            assert c.identity().generation == -1
        assert [r.step(StepOrders()) for r in prefill] == [({"r1"}, None)] * 2

        _at_once(prefill, "restore_kv_caches")
        with pod.client() as c:
            woke = c.identity().generation
        assert woke == registered + 1
        assert {r.connector._worker.generation for r in prefill} == {woke}
        sched.stale({0, 1})
        _delay, new = finish(sched, "r2", [[4, 5, 6]], N)
        assert new["remote_registration_generation"] == woke
        for rank in prefill:
            pattern.write_pattern(rank.manifest, rank.arrays(), [[4, 5, 6]], seed=7)
        orders = sched.take_orders()
        assert [r.step(orders) for r in prefill] == [(None, None)] * 2

        dreq = SimpleNamespace(request_id="d2", prompt_token_ids=list(range(N)),
                               kv_transfer_params=dict(new))  # fmt: skip
        d_sched = prefill_side(list, 128)  # the decode engine's scheduler side (no pod)
        count, _ = d_sched.matched_tokens(dreq, 0)
        d_sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: [[13, 14, 15]]), count)
        assert step_until(decode, d_sched.take_orders(), 1, 60, "the pull") == {"d2"}
        assert decode.connector.get_block_ids_with_load_errors() == set()
        assert pattern.verify_pattern(decode.manifest, decode.arrays(), [[13, 14, 15]],
                                      seed=7) is None  # fmt: skip
        sending = wait_until(lambda: prefill[0].step(StepOrders())[0], 30, "release")
        assert sending == {"r2"}


@pytest.mark.nixl
def test_a_decode_that_will_not_read_declines_the_pods_one_ticket(engines, monkeypatch, tmp_path):
    """A decode request aborted before it loads: its worker declines the one ticket through its
    own sidecar, the pod releases the hold at once, and both prefill workers free the blocks."""
    with _pod_engine(engines, monkeypatch, tmp_path) as (_pe, prefill, pod, _de, (decode,)):
        with pod.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], 128, tp_size=2, pod=True)
        _delay, params = finish(sched, "r1", [[1, 2, 3]], N)
        orders = sched.take_orders()
        assert [r.step(orders) for r in prefill] == [(None, None)] * 2

        d_sched = prefill_side(list, 128)
        dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(N)),
                               kv_transfer_params=dict(params),
                               status=SimpleNamespace(name="FINISHED_ABORTED"))  # fmt: skip
        d_sched.decline(dreq)
        (decline,) = d_sched.orders.declines
        assert decline.tickets == params["kvxferd_tickets"] and decline.reason == "aborted"
        decode.step(d_sched.take_orders())  # the outbox sends it from its own thread

        def released() -> list[str]:
            with pod.client() as c:
                return [h.reason for h in c.released(0).holds]

        assert wait_until(released, 30, "the decline") == ["declined"]
        assert [r.step(StepOrders()) for r in prefill] == [({"r1"}, None)] * 2


@pytest.mark.nixl
def test_a_pod_workers_sleep_returns_only_once_the_pod_let_its_memory_go(
    engines, monkeypatch, tmp_path
):
    """A decode claimed the pod's hold and may still READ every rank's memory: the worker whose
    unregister the sidecar refuses because another rank's runs (or finds it gone) waits for
    that unregister to end, so vLLM's sleep never frees a rank's memory under that READ."""
    from tests.vllm.test_sleep import _claim

    with _pod_engine(engines, monkeypatch, tmp_path) as (_pe, prefill, pod, _de, _d):
        with pod.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], 128, tp_size=2, pod=True)
        _delay, params = finish(sched, "r1", [[1, 2, 3]], N)
        orders = sched.take_orders()
        assert [r.step(orders) for r in prefill] == [(None, None)] * 2
        _claim(pod, params)  # 8 s, never read nor notified

        def leaving() -> bool:
            with pod.client() as c:
                try:
                    c.released(0)
                except NotRegisteredError as exc:
                    return "unregistering" in str(exc)
            return False

        def gone() -> int:
            with pod.client() as c:
                return c.identity().generation

        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(prefill[0].connector.unregister_kv_caches)
            wait_until(leaving, 30, "rank 0's unregister to start")
            prefill[1].connector.unregister_kv_caches()
            assert gone() == -1  # rank 1 returned once the pod had gone, not before
            first.result(timeout=60)
        assert [r.step(StepOrders()) for r in prefill] == [({"r1"}, None)] * 2


@pytest.mark.nixl
def test_after_an_unregister_behind_the_engine_its_workers_register_the_pod_again(
    engines, monkeypatch, tmp_path
):
    """An operator unregisters the pod behind the running engine: the next step's holds are
    refused on every worker (freed at once), and the workers, stepping at once as vLLM's do,
    register again; their registers pair up into one new generation, and the scheduler's
    re-read identity mints tickets for it."""
    with _pod_engine(engines, monkeypatch, tmp_path) as (_pe, prefill, pod, _de, _d):
        with pod.client() as c:
            before = c.identity()
            c.unregister(before.generation)

        def identities():
            with pod.client() as c:
                return [c.identity()]

        sched = prefill_side(identities, 128, tp_size=2, pod=True)
        sched._known = [before]  # read before the unregister: its ticket names the old one
        finish(sched, "r1", [[1, 2, 3]], N)
        orders = sched.take_orders()
        with ThreadPoolExecutor(2) as pool:
            steps = [pool.submit(r.step, orders) for r in prefill]
            assert [s.result(timeout=60) for s in steps] == [({"r1"}, None)] * 2
        with pod.client() as c:
            after = c.identity()
        assert after.generation == before.generation + 1 and after.instance == before.instance
        assert {r.connector._worker.generation for r in prefill} == {after.generation}
        metas = [r.connector.build_connector_worker_meta() for r in prefill]
        assert [m.stale_ranks for m in metas] == [{0}, {1}]  # each tells the scheduler
        sched.stale(metas[0].aggregate(metas[1]).stale_ranks)
        _delay, params = finish(sched, "r2", [[4, 5, 6]], N)
        assert params["remote_registration_generation"] == after.generation
        orders = sched.take_orders()
        assert [r.step(orders) for r in prefill] == [(None, None)] * 2  # held


@pytest.mark.nixl
def test_a_restarted_pod_engine_takes_its_pod_back_and_a_second_one_is_refused_at_start(
    engines, monkeypatch, tmp_path
):
    """Each worker holds its rank's engine lock: a second engine's rank given the running pod
    stops at start, touching nothing. An engine restarted after the first exited without
    unregistering (its locks gone with it) finds the old pod registered under another instance:
    its workers unregister it once between them and register the new pod."""
    with _pod_engine(engines, monkeypatch, tmp_path) as (p_engine, prefill, pod, _de, _d):
        with pod.client() as c:
            before = c.identity()
        taken = f"sidecar_socket: {pod.socket} is in use by another engine (pid {os.getpid()})"
        with pytest.raises(PathInUseError, match="^" + re.escape(taken) + "$"):
            Rank(p_engine, "LBHNC", pod, 1)
        with pod.client() as c:
            assert c.identity() == before

        for rank in prefill:  # the engine exits without unregistering (killed)
            rank.connector._worker.generation = -1
            rank.close()
        prefill.clear()
        monkeypatch.setattr(p_engine.config, "instance_id", "restarted")
        again = [Rank(p_engine, "LBHNC", pod, r, register=False) for r in range(2)]
        prefill += again  # closed on the way out
        _register_at_once(again)
        with pod.client() as c:
            after = c.identity()
        assert after.generation == before.generation + 1 and after.instance != before.instance
        assert {r.connector._worker.generation for r in again} == {after.generation}
        assert {r.connector._worker.instance for r in again} == {after.instance}


@pytest.mark.nixl
def test_a_rank_sidecar_and_a_pod_sidecar_each_refuse_the_other_setting(
    engines, monkeypatch, tmp_path
):
    """A pod sidecar without ``"pod"`` (its ranks would each mint a ticket), and ``"pod"``
    with a rank's own sidecar: refused at start, saying which setting to change; nothing is
    registered."""
    engine = engines("dense", "LBHNC", num_blocks=24, tp_size=2)
    (pod,) = start_sidecars(str(tmp_path), ["pod"], "--pod-ranks", "2")
    (rank_side,) = start_sidecars(str(tmp_path), ["r"])
    try:
        said = f"sidecar at {pod.socket} serves a pod of 2 ranks (serve --pod-ranks): set "
        with pytest.raises(ConfigError, match="^" + re.escape(said)):
            Rank(engine, "LBHNC", pod, tp_rank=0)
        extra = engine.config.kv_transfer_config.kv_connector_extra_config
        monkeypatch.setitem(extra, "pod", True)
        said = (f"sidecar at {rank_side.socket} serves 1 rank(s) (serve --pod-ranks), but "
                '"pod" is set and this engine has TP 2: start it with --pod-ranks 2')  # fmt: skip
        with pytest.raises(ConfigError, match="^" + re.escape(said) + "$"):
            Rank(engine, "LBHNC", rank_side, tp_rank=0)
        for side in (pod, rank_side):
            with side.client() as c:
                assert c.identity().generation == -1
    finally:
        assert pod.stop() == 0
        rank_side.stop()


@pytest.mark.nixl
@pytest.mark.parametrize("model", ["dense", "nemotron-h"])
def test_each_pod_worker_saves_its_own_rank_and_a_restarted_pod_loads_every_rank_back(
    engines, monkeypatch, tmp_path, model
):
    """With the store on, each worker of a TP 2 prefill sharing a pod sidecar saves its own
    rank's blocks of a finished request (entries of its rank); after a restart (a new pod
    sidecar process, fresh memory, a new scheduler) the same prompt is looked up on rank 0 and
    every worker loads its own rank's bytes: every byte of every layer of every loaded block
    verified on each rank, nothing outside them written, and vLLM computes only the tail.
    Hybrid: each rank's Mamba state shard too, the conversation going on (as in test_store)."""
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    engine = engines(model, stores.LAYOUT, num_blocks=32, tp_size=2)
    cfg = engine.config.kv_transfer_config
    monkeypatch.setattr(cfg, "kv_connector_extra_config", dict(cfg.kv_connector_extra_config))
    prompt = [(5 * i) % 800 + 1 for i in range(N)]
    hybrid = model != "dense"  # saves the state after its answer: the next turn loads it
    saved = N + 1 if hybrid else N
    first = stores.Engine(engine, tmp_path, "pod1", pod=True)
    try:
        assert first.sched.connector._sched.store is not None  # the pod takes the store
        assert [s.num_tokens for s in first.run("r1", prompt, 2 if hybrid else 1)] == [saved]
    finally:
        first.close()
    entries = [parse_filename(p.name) for p in (tmp_path / "store").rglob("*.kvx")]
    assert {(e.tp_size, e.tp_rank) for e in entries} == {(2, 0), (2, 1)}  # each rank its own

    second = stores.Engine(engine, tmp_path, "pod2", pod=True)
    try:
        again = prompt + [7, 7] if hybrid else prompt  # the step helper samples token 7
        load, before, answer = stores.admit_load(second, "r2", again)
        assert (load.num_tokens, load.error, answer) == (saved, "", (None, {"r2"}))
        stores.check_loaded(second, load, saved, before)
        assert metric(second.sidecar.peer, "kvxferd_store_loads_total", outcome="done") == 2
        stores.computes_only_the_tail(second, "r2")
    finally:
        second.close()


@pytest.mark.parametrize(
    ("extra", "tp", "role", "said"),
    [
        ({"sidecar_socket": "/x/e{rank}.sock"}, 2, "kv_both",
         "pod: sidecar_socket names one socket for every rank (no {rank})"),
        ({}, 1, "kv_both", "pod: tensor_parallel_size is 1: a pod serves 2 ranks or more"),
        ({}, 2, "kv_consumer", "pod: kv_role is kv_consumer: a pod sidecar only holds"),
        ({"pod": "yes"}, 2, "kv_both", "pod: expected true or false, got 'yes'"),
    ],
)  # fmt: skip
def test_what_a_pod_cannot_serve_is_refused_at_start(engines, monkeypatch, extra, tp, role, said):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    engine = engines("dense", "LBHNC", num_blocks=24, **({"tp_size": tp} if tp > 1 else {}))
    config = engine.config.kv_transfer_config
    monkeypatch.setattr(config, "kv_connector_extra_config", {"pod": True, **extra})
    monkeypatch.setattr(config, "kv_role", role)
    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        KvxferdConnector(engine.config, KVConnectorRole.SCHEDULER, engine.kv_cache_config)


def test_a_decode_request_reaching_a_pod_engine_is_computed_locally_and_its_ticket_declined():
    """A pod sidecar only holds (it refuses pulls): the scheduler drops the params at once."""
    ident = Identity(engine_id="P", epoch=1, generation=3, peer_address="127.0.0.1:1", tp_rank=0,
                     tp_size=2, default_lease_s=30.0, pod_ranks=2)  # fmt: skip
    sched = prefill_side(lambda: [ident], 128, tp_size=2, pod=True)
    _delay, params = finish(sched, "r1", [[1, 2, 3]], N)
    sched.take_orders()
    req = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(N)),
                          kv_transfer_params=dict(params))  # fmt: skip
    assert sched.matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    (decline,) = sched.take_orders().declines
    assert decline.reason == "computed_locally" and decline.tickets == params["kvxferd_tickets"]


def test_a_pod_scheduler_mints_one_ticket_from_its_one_identity_and_none_from_a_rank_sidecar():
    ident = Identity(engine_id="P", epoch=1, generation=3, peer_address="127.0.0.1:1", tp_rank=0,
                     tp_size=2, default_lease_s=30.0, pod_ranks=2)  # fmt: skip
    sched = prefill_side(lambda: [ident], 128, tp_size=2, pod=True)
    delay, params = finish(sched, "r1", [[1, 2, 3]], N)
    (ticket,) = params["kvxferd_tickets"]
    assert delay and ticket["ranks"] == 2 and ticket["tp_size"] == 2
    verify_ticket(msgspec.convert(ticket, Ticket), TOKEN.encode())  # signed as the pod signs
    (hold,) = sched.take_orders().holds
    assert hold.minted == [(1, 3)]
    rank_ident = Identity(engine_id="P", epoch=1, generation=3, peer_address="127.0.0.1:1",
                          tp_rank=0, tp_size=2, default_lease_s=30.0)  # fmt: skip
    sched = prefill_side(lambda: [rank_ident], 128, tp_size=2, pod=True)
    assert finish(sched, "r2", [[1, 2, 3]], N) == (False, None)  # the workers refuse it anyway


@pytest.mark.nixl
def test_a_pod_worker_whose_register_gets_no_answer_tries_the_same_register_again(
    engines, monkeypatch, tmp_path, caplog
):
    """Rank 0 registers long before rank 1 (its client gives up after 1 s here): its register
    gets no answer while the pod waits for rank 1. The worker sends the same register again
    (logged), which the pod counts as that register, and the engine starts once rank 1 came,
    both ranks on the pod's one registration."""
    monkeypatch.setenv("KVXFERD_PEER_TOKEN", TOKEN)
    monkeypatch.setattr(worker_module, "EngineClient",
                        functools.partial(EngineClient, timeout_s=1.0))  # fmt: skip
    engine = engines("dense", "LBHNC", num_blocks=24, tp_size=2)
    monkeypatch.setitem(engine.config.kv_transfer_config.kv_connector_extra_config, "pod", True)
    (pod,) = start_sidecars(str(tmp_path), ["pod"], "--pod-ranks", "2")
    caplog.set_level("INFO", logger="kvxferd.vllm.worker")
    ranks = [Rank(engine, "LBHNC", pod, r, register=False) for r in range(2)]

    def no_answer() -> bool:
        return any("register got no answer" in r.getMessage() for r in caplog.records)

    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(ranks[0].register)
            wait_until(lambda: no_answer() or first.done(), 30, "rank 0's register to time out")
            ranks[1].register()
            first.result(timeout=60)  # before: SidecarUnreachableError, no answer
        with pod.client() as c:
            ident = c.identity()
        assert ident.generation >= 0
        assert {r.connector._worker.generation for r in ranks} == {ident.generation}
        sched = prefill_side(lambda: [ident], 128, tp_size=2, pod=True)
        finish(sched, "r1", [[1, 2, 3]], N)
        orders = sched.take_orders()
        assert [r.step(orders) for r in ranks] == [(None, None)] * 2  # held by both ranks
    finally:
        for rank in ranks:
            rank.close()
        pod.stop()
