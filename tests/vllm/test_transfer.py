"""The worker side on vLLM's own ``allocate_kv_cache`` tensors, placed in shared memory: a
prefill and a decode connector, each with a real ``kvxferd serve`` sidecar, move a request's
blocks over real NIXL; every byte of every layer and part is checked with kvxferd.pattern, and
nothing outside the pulled blocks changes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvxferd import pattern
from kvxferd.vllm.scheduler import SchedulerSide
from tests.sidecar.harness import changed_outside, start_sidecars, wait_until
from tests.vllm.ranks import Rank, finish, prefill_side, step_until, worker_pair

pytestmark = pytest.mark.nixl


def _ids(engine, first: int, n_tokens: int) -> list[list[int]]:
    """Distinct block ids per group (one shared pool): attention a block per 128 tokens, Mamba
    null blocks then the running-state block at the end (vLLM's align mode)."""
    per = -(-n_tokens // engine.config.cache_config.block_size)
    out, nxt = [], first
    for group in engine.kv_cache_config.kv_cache_groups:
        if type(group.kv_cache_spec).__name__ == "MambaSpec":
            out.append([0] * (per - 1) + [nxt])
            nxt += 1
        else:
            out.append(list(range(nxt, nxt + per)))
            nxt += per
    return out


@pytest.mark.parametrize(
    "model,layout",
    [("dense", "LBHNC"), ("dense", "BLNHC"), ("nemotron-h", "LBHNC"), ("qwen3-next", "BHLNC")],
)
def test_a_request_moves_byte_exact_between_two_vllm_workers(engines, model, layout, tmp_path):
    engine = engines(model, layout, num_blocks=24)
    with worker_pair(tmp_path, layout, engine) as (prefill, decode, p_side):
        with p_side.client() as c:
            ident = c.identity()
        hybrid = engine.config.model_config.is_hybrid
        sched = prefill_side(
            lambda: [ident], engine.config.cache_config.block_size, partial_prefill=hybrid
        )
        n = 300
        p_ids = _ids(engine, 1, n)
        delay, params = finish(sched, "r1", p_ids, n)
        assert delay and params["kvxferd_tickets"]
        held = [[b for b in g if b] for g in p_ids]
        pattern.write_pattern(prefill.manifest, prefill.arrays(), held, seed=11)
        assert prefill.step(sched.take_orders()) == (None, None)  # hold placed

        d_ids = _ids(engine, 7, n)
        before = [a.copy() for a in decode.arrays()]
        dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(n)),
                               kv_transfer_params=dict(params))  # fmt: skip
        count, is_async = sched.matched_tokens(dreq, 0)
        assert is_async and count == (n - 1 if hybrid else n)
        sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: d_ids), count)
        got = step_until(decode, sched.take_orders(), 1, 60, "the pull to finish")
        assert got == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == set()
        wanted = [[b for b in g if b] for g in d_ids]
        assert pattern.verify_pattern(decode.manifest, decode.arrays(), wanted, seed=11) is None
        assert changed_outside(before, decode.arrays(), decode.manifest, wanted) == 0
        # The reader's notification ends the hold: the prefill frees its blocks once.
        sending = wait_until(lambda: prefill.step(type(sched.orders)())[0], 30, "hold release")
        assert sending == {"r1"}


def test_a_decode_that_vllm_queues_past_the_lease_keeps_the_hold_and_then_pulls_it(
    engines, tmp_path
):
    """Prefill leases of 2 s: while vLLM queues the decode request (no blocks for it yet), the
    connector keeps its holds alive, so the pull that starts after the first lease ended still
    reads every byte."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine, flags=("--lease", "2")) as (
        prefill, decode, p_side,
    ):  # fmt: skip
        with p_side.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], engine.config.cache_config.block_size)
        n = 300
        p_ids = _ids(engine, 1, n)
        _delay, params = finish(sched, "r1", p_ids, n)
        pattern.write_pattern(prefill.manifest, prefill.arrays(), p_ids, seed=12)
        assert prefill.step(sched.take_orders()) == (None, None)  # hold placed, 2 s lease
        dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(n)),
                               kv_transfer_params=dict(params))  # fmt: skip
        sched.queued(dreq)  # vLLM has it, but no blocks for it yet
        lease_end = params["kvxferd_tickets"][0]["expires_at"]
        kept = []

        def past_the_lease() -> bool:
            orders = sched.take_orders()
            kept.extend(orders.keepalives)
            decode.step(orders)
            return time.time() > lease_end + 1.0

        wait_until(past_the_lease, 30, "the hold's first lease to end")
        assert kept and all(t["hold_id"] == params["kvxferd_tickets"][0]["hold_id"] for t in kept)
        d_ids = _ids(engine, 7, n)
        before = [a.copy() for a in decode.arrays()]
        count, _ = sched.matched_tokens(dreq, 0)
        sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: d_ids), count)
        assert step_until(decode, sched.take_orders(), 1, 60, "the pull to finish") == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == set()
        assert pattern.verify_pattern(decode.manifest, decode.arrays(), d_ids, seed=12) is None
        assert changed_outside(before, decode.arrays(), decode.manifest, d_ids) == 0
        assert sched.take_orders().keepalives == []  # allocated: its claim pins the hold now


def _unheld_request(engine, p_side) -> tuple[SchedulerSide, SimpleNamespace]:
    """A scheduler side (no group kinds) and decode request "d1" (300 tokens) carrying the
    ticket of prefill "r1" on blocks 3-5, whose hold the prefill worker never places."""
    with p_side.client() as c:
        ident = c.identity()
    sched = prefill_side(
        lambda: [ident], engine.config.cache_config.block_size, partial_prefill=False
    )
    _delay, params = finish(sched, "r1", ([3, 4, 5],), 300)
    sched.take_orders()  # the prefill worker never places the hold: a claim finds none
    dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(300)),
                           kv_transfer_params=dict(params))  # fmt: skip
    return sched, dreq


def test_a_pull_that_cannot_complete_reports_its_blocks_as_load_errors(engines, tmp_path):
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, decode, p_side):
        sched, dreq = _unheld_request(engine, p_side)
        count, _ = sched.matched_tokens(dreq, 0)
        sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: [[9, 10, 11]]), count)
        got = step_until(decode, sched.take_orders(), 1, 60, "the pull to end")
        assert got == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == {9, 10, 11}
        assert decode.connector.get_block_ids_with_load_errors() == set()  # reported once


def test_a_load_promised_on_tickets_for_other_groups_ends_with_its_blocks_as_load_errors(
    engines, tmp_path
):
    """Without group kinds to check tickets against early, tokens are promised before the
    decode's blocks show the mismatch: the load still ends (no request waits forever), every
    block a load error, and the tickets are declined."""
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (_prefill, decode, p_side):
        sched, dreq = _unheld_request(engine, p_side)
        assert sched.group_kinds is None
        count, is_async = sched.matched_tokens(dreq, 0)
        assert is_async and count == 300
        local = [[9, 10, 11], [0, 12]]  # two groups here, one in the tickets
        sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: local), count)
        orders = sched.take_orders()
        assert orders.pulls == [] and [d.reason for d in orders.declines] == ["malformed"]
        got = step_until(decode, orders, 1, 60, "the failed load to be reported")
        assert got == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == {9, 10, 11, 12}


# Request ids vLLM may take from a client (X-Request-Id, the body's request_id) that no sidecar
# takes: too long, or a newline that would forge a log line.
REFUSED_IDS = ["cmpl-" + "x" * 508, "chatcmpl-r\nforged log line"]


def test_a_prefill_whose_request_id_the_sidecar_refuses_frees_its_blocks_at_once(
    engines, tmp_path, caplog
):
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, _decode, p_side):
        with p_side.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], engine.config.cache_config.block_size)
        for i, rid in enumerate([*REFUSED_IDS, "r-ok"]):
            assert finish(sched, rid, ([3 * i + 1, 3 * i + 2],), 200)[0]
        # No hold for the refused ids, so nobody can read them: finished at once, blocks freed.
        sending, _ = prefill.step(sched.take_orders())
        assert sending == set(REFUSED_IDS)
        with p_side.client() as c:
            assert c.identity().engine_id == ident.engine_id  # the sidecar keeps serving
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 2 and not any("\n" in m for m in refused)  # one line each


def test_a_decode_whose_request_id_the_sidecar_refuses_reports_its_blocks_as_load_errors(
    engines, tmp_path
):
    engine = engines("dense", "LBHNC", num_blocks=24)
    with worker_pair(tmp_path, "LBHNC", engine) as (prefill, decode, p_side):
        with p_side.client() as c:
            ident = c.identity()
        sched = prefill_side(lambda: [ident], engine.config.cache_config.block_size)
        _delay, params = finish(sched, "r1", ([3, 4, 5],), 300)
        assert prefill.step(sched.take_orders()) == (None, None)  # hold placed
        for i, rid in enumerate(REFUSED_IDS):
            dreq = SimpleNamespace(request_id=rid, prompt_token_ids=list(range(300)),
                                   kv_transfer_params=dict(params))  # fmt: skip
            count, is_async = sched.matched_tokens(dreq, 0)
            assert is_async and count == 300
            local = [[9 + 3 * i, 10 + 3 * i, 11 + 3 * i]]
            sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda ids=local: ids), count)
            got = step_until(decode, sched.take_orders(), 1, 60, "the refused pull to end")
            assert got == {rid}
            assert decode.connector.get_block_ids_with_load_errors() == set(local[0])


@pytest.mark.parametrize(
    "model,p_tp,d_tp,conv",
    [
        ("dense", 2, 1, "SD"),
        ("dense", 1, 2, "SD"),
        ("nemotron-h", 2, 1, "SD"),
        ("nemotron-h", 1, 2, "SD"),
        ("qwen3-next", 2, 1, "SD"),
        ("qwen3-next", 1, 2, "SD"),
        ("nemotron-h", 2, 1, "DS"),
        ("qwen3-next", 1, 2, "DS"),
    ],
)
def test_heterogeneous_tp_moves_every_head_byte_exact(
    engines, monkeypatch, model, p_tp, d_tp, conv, tmp_path
):
    """Each rank beside its own sidecar: TP 2 -> 1 (one decode rank reads both prefill ranks'
    heads) and TP 1 -> 2 (each decode rank reads its half; the prefill hold ends once both
    have read). Hybrids too: vLLM's SD conv state (every row holds all channels) is read per
    section (x|B|C, Q|K|V) and TP unit, one run per row (DS: one run per unit), so every head,
    group and SSM state of the running-state block arrives byte-exact at the other TP size."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    layout = "LBHNC"
    if conv == "DS":  # VLLM_SSM_CONV_STATE_LAYOUT=DS for the engines and connectors built here
        from kvxferd.vllm import cpu
        from tests.vllm.conftest import config_dir

        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        get_conv_state_layout.cache_clear()
        p_eng = cpu.build(config_dir(model), num_blocks=24, layout=layout, tp_size=p_tp)
        d_eng = cpu.build(config_dir(model), num_blocks=24, layout=layout, tp_size=d_tp)
    else:
        p_eng = engines(model, layout, num_blocks=24, tp_size=p_tp)
        d_eng = engines(model, layout, num_blocks=24, tp_size=d_tp)
    names = [f"p{r}" for r in range(p_tp)] + [f"d{r}" for r in range(d_tp)]
    sides = start_sidecars(str(tmp_path), names)
    ranks: list[Rank] = []
    try:
        prefill = [Rank(p_eng, layout, sides[r], tp_rank=r) for r in range(p_tp)]
        ranks += prefill
        decode = [Rank(d_eng, layout, sides[p_tp + r], tp_rank=r) for r in range(d_tp)]
        ranks += decode
        idents = []
        for side in sides[:p_tp]:
            with side.client() as c:
                idents.append(c.identity())
        hybrid = p_eng.config.model_config.is_hybrid
        sched = prefill_side(
            lambda: idents,
            p_eng.config.cache_config.block_size,
            tp_size=p_tp,
            partial_prefill=hybrid,
        )
        n = 300
        p_ids = _ids(p_eng, 1, n)
        _delay, params = finish(sched, "r1", p_ids, n)
        assert [t["tp_rank"] for t in params["kvxferd_tickets"]] == list(range(p_tp))
        held = [[b for b in g if b] for g in p_ids]
        orders = sched.take_orders()
        for rank in prefill:
            pattern.write_pattern(rank.manifest, rank.arrays(), held, seed=23)
            assert rank.step(orders) == (None, None)

        d_ids = _ids(d_eng, 7, n)
        wanted = [[b for b in g if b] for g in d_ids]
        before = [[a.copy() for a in rank.arrays()] for rank in decode]
        dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(n)),
                               kv_transfer_params=dict(params))  # fmt: skip
        count, _ = sched.matched_tokens(dreq, 0)
        sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: d_ids), count)
        orders = sched.take_orders()
        for i, rank in enumerate(decode):
            got = step_until(rank, orders, 1, 60, f"decode rank {i}")
            assert got == {"d1"}
            assert rank.connector.get_block_ids_with_load_errors() == set()
            if hybrid:  # the conv state is read by section: every part sliceable
                mamba = [la for g in rank.manifest.groups if g.kind == "mamba" for la in g.layers]
                parts = [p for la in mamba for p in la.conv]
                assert {la.conv_layout for la in mamba} == {conv}
                assert len(parts) == 3 * len(mamba) and all(p.sliceable for p in parts)
                assert all((p.rows > 1) == (conv == "SD") for p in parts)
            assert pattern.verify_pattern(rank.manifest, rank.arrays(), wanted, seed=23) is None
            assert changed_outside(before[i], rank.arrays(), rank.manifest, wanted) == 0
        for i, rank in enumerate(prefill):  # every reader notified: each rank frees once
            sending = wait_until(lambda r=rank: r.step(type(orders)())[0], 30, f"release {i}")
            assert sending == {"r1"}
    finally:
        for rank in ranks:
            rank.close()
        for side in sides:
            side.stop()
        monkeypatch.undo()
        get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("p_bs,d_bs", [(128, 64), (64, 128)])
def test_different_block_sizes_re_block_every_token_byte_exact(engines, p_bs, d_bs, tmp_path):
    """The decode names its own blocks at its own block size; the sidecars map vLLM's packed
    K|V token rows between the two kernel block sizes (kvxferd.descriptors.reblock): every
    token of every layer, part and head verifies, and nothing outside those tokens changes."""

    layout = "LBHNC"
    p_eng = engines("dense", layout, num_blocks=24, block_size=p_bs)
    d_eng = engines("dense", layout, num_blocks=24, block_size=d_bs)
    assert p_eng.config.cache_config.block_size == p_bs
    assert d_eng.config.cache_config.block_size == d_bs
    with worker_pair(tmp_path, layout, p_eng, d_eng) as (prefill, decode, p_side):
        with p_side.client() as c:
            ident = c.identity()

        def side(bs: int) -> SchedulerSide:
            return prefill_side(lambda: [ident], bs, group_kinds=["attention"])

        p_sched, d_sched = side(p_bs), side(d_bs)
        n = 300
        p_ids = _ids(p_eng, 1, n)
        _delay, params = finish(p_sched, "r1", p_ids, n)
        assert params["remote_block_size"] == p_bs
        pattern.write_token_pattern(prefill.manifest, prefill.arrays(), p_ids, n, seed=31)
        assert prefill.step(p_sched.take_orders()) == (None, None)

        d_ids = _ids(d_eng, 7, n)
        assert decode.manifest.groups[0].layers[0].k.rows > 1  # vLLM's packed K|V token rows
        assert pattern.verify_token_pattern(decode.manifest, decode.arrays(), d_ids, n, 31)
        before = [a.copy() for a in decode.arrays()]
        dreq = SimpleNamespace(request_id="d1", prompt_token_ids=list(range(n)),
                               kv_transfer_params=dict(params))  # fmt: skip
        count, _ = d_sched.matched_tokens(dreq, 0)
        d_sched.after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: d_ids), count)
        orders = d_sched.take_orders()
        assert orders.pulls[0].block_ids == d_ids  # its own ids, at its own block size
        got = step_until(decode, orders, 1, 60, "the pull to end")
        assert got == {"d1"}
        assert decode.connector.get_block_ids_with_load_errors() == set()
        arrays = decode.arrays()
        assert pattern.verify_token_pattern(decode.manifest, arrays, d_ids, n, seed=31) is None
        mask = pattern.token_footprint(decode.manifest, d_ids, n)
        assert mask[0].any()
        assert not any(((b != a) & ~m).any() for b, a, m in zip(before, arrays, mask, strict=True))
