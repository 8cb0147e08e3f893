"""Re-blocking: when the two sides' block sizes differ, tokens move, not blocks.

Specification by a per-byte oracle (:func:`.oracle.label_tokens`): each attention byte is named
by (group, layer, part, global TP unit, token, byte of the token row) on both sides, each state
byte by (group, layer, part, unit, byte); a plan is right when every byte of the tokens the
decode asks for (every layer, part, TP unit) is written exactly once over all prefill ranks,
from the remote byte with the same name, and no other local byte is written.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.descriptors import (
    compare_manifests,
    plan_pull,
    plan_read,
    read_geometry,
)
from kvxferd.errors import BlockIdError, IncompatiblePeerError
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.wire import Manifest

from . import oracle
from .layouts import AttnSpec, ModelSpec, hybrid_spec, render, render_packed
from .strategies import model_specs

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    """A decode rank, every prefill rank, both sides' ids and token counts."""

    local: Manifest
    remotes: list[Manifest]
    lids: list[np.ndarray]
    rids: list[np.ndarray]
    num_tokens: int
    remote_tokens: int


def _side_ids(draw, m: Manifest, tokens: int, local: bool, pool: list[int]) -> list[np.ndarray]:
    """Block ids per group for ``tokens`` tokens at this side's block sizes, drawn from ``pool``.

    Full attention: one id per block from block 0 (contiguous or fragmented; on the decode some
    -1: prefix-cache hits it already has). Sliding window: -1 before the window, or a list of
    just the last blocks. Mamba: one state block, or -1s then the state block.
    """
    out = []
    for group in m.groups:
        nblk = -(-tokens // group.block_size)
        if group.kind == "mamba":
            n = 1 if draw(st.booleans()) else max(1, nblk)
            ids = [-1] * (n - 1) + [pool.pop()]
        elif group.kind == "sliding_window":
            first = max(0, tokens - group.sliding_window) // group.block_size
            extra = draw(st.integers(0, first))
            if draw(st.booleans()):
                ids = [-1] * (first - extra) + [pool.pop() for _ in range(nblk - first + extra)]
            else:
                ids = [pool.pop() for _ in range(nblk - first + extra)]
        else:
            if draw(st.booleans()):  # contiguous ids
                run = sorted(pool[-nblk:]) if nblk else []
                del pool[len(pool) - nblk :]
                ids = run
            else:
                ids = [pool.pop() for _ in range(nblk)]
            if local and ids:
                skip = draw(st.lists(st.integers(0, nblk - 1), max_size=2))
                ids = [-1 if k in skip else b for k, b in enumerate(ids)]
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def _blocks_needed(spec: ModelSpec, tokens: int) -> int:
    bs = spec.attn.kbs * spec.attn.ratio if spec.attn else 1
    n = len(spec.attn_groups) * (-(-tokens // bs) + 1) + len(spec.mamba_groups) * max(1, tokens)
    return n + 2


@st.composite
def cases(draw, hetero_tp: bool = False) -> Case:
    """A random model on both sides with independent block and kernel block sizes, packs and
    (dense) K/V order; hetero_tp: TP 1/2/4 on each side (HND attention, DS conv)."""
    kw = {"head_layout": "HND", "conv_layout": "DS"} if hetero_tp else {}
    spec: ModelSpec = draw(model_specs(**kw))
    rspec = spec
    if spec.attn:
        rspec = replace(spec, attn=replace(spec.attn, kbs=draw(st.integers(1, 3)),
                                           ratio=draw(st.integers(1, 5))))  # fmt: skip
    if spec.mamba_groups and draw(st.booleans()):  # the same mamba layers, grouped otherwise
        total, split = sum(spec.mamba_groups), []
        while sum(split) < total:
            split.append(draw(st.integers(1, total - sum(split))))
        rspec = replace(rspec, mamba_groups=tuple(split))
    tp_l, tp_r = (draw(st.sampled_from([1, 2, 4])) for _ in range(2)) if hetero_tp else (1, 1)
    remote_tokens = draw(st.integers(1, 40))
    attention_only = not spec.mamba_groups and len(spec.attn_groups) == 1
    num_tokens = draw(st.integers(1, remote_tokens)) if attention_only else remote_tokens
    lnb = _blocks_needed(spec, num_tokens)
    rnb = _blocks_needed(rspec, remote_tokens)
    local = render(spec, tp_l, draw(st.integers(0, tp_l - 1)), num_blocks=lnb)
    pack = draw(st.integers(1, 3))
    order = draw(st.sampled_from(["kv_first", "blocks_first"]))
    remotes = [render(rspec, tp_r, r, num_blocks=rnb, pack=pack, kv_order=order)
               for r in range(tp_r)]  # fmt: skip
    lpool = list(draw(st.permutations(range(lnb))))
    rpool = list(draw(st.permutations(range(rnb))))
    lids = _side_ids(draw, local, num_tokens, True, lpool)
    rids = _side_ids(draw, remotes[0], remote_tokens, False, rpool)
    return Case(local, remotes, lids, rids, num_tokens, remote_tokens)


def check_exact_tokens(case: Case, coalesce: bool = True) -> int:
    """Assert the oracle's spec over every prefill rank; the descriptor count."""
    want = oracle.label_tokens(case.local, case.lids, case.num_tokens)
    lpos_all, count, kv, state = [], 0, 0, 0
    for remote in case.remotes:
        have = oracle.label_tokens(remote, case.rids, case.remote_tokens, case.num_tokens)
        geo = read_geometry(case.local, remote)
        if coalesce:
            plan = plan_pull(geo, case.lids, case.rids, case.num_tokens, case.remote_tokens)
        else:
            assert geo.reblock is not None
            plan = geo.reblock.plan(case.lids, case.rids, case.num_tokens, case.remote_tokens,
                                    coalesce=False)  # fmt: skip
        lpos = oracle.local_positions(case.local, plan)
        rpos = oracle.remote_positions(remote, plan)
        assert (want[lpos] >= 0).all(), "a descriptor writes a byte outside the asked tokens"
        np.testing.assert_array_equal(want[lpos], have[rpos])
        assert plan.total_bytes == int(plan.length.sum())
        lpos_all.append(lpos)
        count += plan.num_descriptors
        kv, state = kv + plan.kv_bytes, state + plan.state_bytes
    hits = np.bincount(np.concatenate(lpos_all), minlength=want.size)
    np.testing.assert_array_equal(hits, (want >= 0).astype(np.int64))
    return count


def _differs(case: Case) -> bool:
    """Whether block ids cannot pair up (block sizes or grouping differ)."""
    return read_geometry(case.local, case.remotes[0]).reblock is not None


@SETTINGS
@given(cases(), st.booleans())
def test_every_asked_token_lands_once_at_its_place_and_nothing_else_is_written(case, coalesce):
    if not _differs(case):  # equal sizes map block ids (tested in test_mapping)
        return
    check_exact_tokens(case, coalesce)


@SETTINGS
@given(cases(hetero_tp=True))
def test_hetero_tp_and_different_block_sizes_fill_every_unit_of_every_token_once(case):
    if not _differs(case):
        return
    check_exact_tokens(case)


@SETTINGS
@given(cases())
def test_coalescing_keeps_the_byte_pairs(case):
    if not _differs(case):
        return
    for remote in case.remotes:
        geo = read_geometry(case.local, remote).reblock
        assert geo is not None
        args = (case.lids, case.rids, case.num_tokens, case.remote_tokens)
        a, b = geo.plan(*args), geo.plan(*args, coalesce=False)
        assert a.num_descriptors <= b.num_descriptors
        assert oracle.byte_pairs(case.local, remote, a) == oracle.byte_pairs(case.local, remote, b)
        assert (a.kv_bytes, a.state_bytes) == (b.kv_bytes, b.state_bytes)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_specs(), st.data())
def test_equal_block_sizes_take_todays_block_id_path(spec, data):
    local, remote = render(spec, num_blocks=64), render(spec, num_blocks=67)
    geo = read_geometry(local, remote)
    assert geo.reblock is None
    n = len(local.groups)
    lids = [np.arange(2) + g * 2 for g in range(n)]
    rids = [ids + 1 for ids in lids]
    want = plan_read(local, remote, lids, rids)
    with_skip = [np.concatenate(([-1], ids)) for ids in lids]
    got = plan_pull(geo, with_skip, [np.concatenate(([0], ids)) for ids in rids],
                    data.draw(st.integers(-1, 5)), 0)  # fmt: skip
    for f in ("local_region", "local_offset", "remote_region", "remote_offset", "length"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f))


# ------------------------------------------------------------------------------------------------
# Fixed cases: descriptor counts, coalescing, the handshake's comparison, refusals


def _hybrid(kbs: int, ratio: int, **kw) -> Manifest:
    spec = hybrid_spec()
    return render(replace(spec, attn=replace(spec.attn, kbs=kbs, ratio=ratio)), **kw)


def test_compare_accepts_different_block_sizes_and_still_names_real_mismatches():
    small, big = _hybrid(2, 2), _hybrid(2, 4)
    assert [g.block_size for g in small.groups] != [g.block_size for g in big.groups]
    assert compare_manifests(small, big) == {}
    other = replace(hybrid_spec(), attn=replace(hybrid_spec().attn, head_size=8))
    diff = compare_manifests(small, render(other))
    assert "groups[0].layers[0].head_size" in diff
    fp8 = replace(hybrid_spec(), attn=replace(hybrid_spec().attn, dtype="float8_e4m3fn", kbs=4))
    diff = compare_manifests(small, render(fp8))
    assert "groups[0].layers[0].dtype" in diff
    # The block-id path refuses them, naming the sizes: only token mapping pairs them up.
    ids = [np.arange(1)] * len(small.groups)
    with pytest.raises(IncompatiblePeerError) as exc:
        plan_read(small, big, ids, ids)
    assert "groups[0].block_size" in exc.value.fields


def test_hnd_token_runs_coalesce_across_both_sides_blocks():
    # One head, one layer slot: a head's tokens are contiguous in a kernel block, and the
    # decode's kernel block (8 tokens) spans two of the prefill's (4): a run per local block.
    attn = replace(hybrid_spec().attn, total_heads=1, kbs=8, ratio=1)
    spec = replace(hybrid_spec(), mamba=None, mamba_groups=(), attn_groups=(1,), attn=attn,
                   kv_order="kv_first")  # fmt: skip
    local = render(spec, num_blocks=8)
    remote = render(replace(spec, attn=replace(spec.attn, kbs=4)), num_blocks=8)
    lids, rids = [np.asarray([3, 4])], [np.asarray([1, 2, 5, 6])]
    plan = plan_pull(read_geometry(local, remote), lids, rids, 16, 16)
    # K and V each: local blocks 3, 4 are adjacent, remote 1, 2 and 5, 6 are: 2 runs per part
    assert plan.num_descriptors == 4
    assert plan.kv_bytes == 2 * 16 * 4 * 2
    case = Case(local, [remote], lids, rids, 16, 16)
    check_exact_tokens(case)


def test_sliding_window_moves_only_the_window():
    spec = replace(hybrid_spec(), mamba=None, mamba_groups=(), attn_groups=(1, 1))
    local = _window(spec, 2, 2)
    remote = _window(spec, 2, 1)
    w = local.groups[1].sliding_window
    assert w == 4
    n = 11  # window: tokens 7..10
    lids = [np.arange(3), np.asarray([-1, 5, 6])]  # block 0 (tokens 0..3) before the window
    rids = [np.arange(6), np.asarray([10, 11, 12])]  # short list: blocks 3..5 (tokens 6..11)
    case = Case(local, [remote], lids, rids, n, n)
    check_exact_tokens(case)
    want = oracle.label_tokens(local, lids, n)
    assert (want >= 0).sum() > 0
    # A window token whose prefill block is gone is refused, naming the list.
    with pytest.raises(BlockIdError) as exc:
        plan_pull(read_geometry(local, remote), lids, [rids[0], np.asarray([-1, 11, 12])], n, n)
    assert exc.value.field.startswith("remote_block_ids[1]")


def _window(spec: ModelSpec, kbs: int, ratio: int) -> Manifest:
    return render(replace(spec, attn=replace(spec.attn, kbs=kbs, ratio=ratio)), num_blocks=16)


def test_mamba_state_moves_last_block_to_last_block_and_needs_all_tokens():
    local, remote = _hybrid(2, 4, num_blocks=24), _hybrid(2, 2, num_blocks=24)
    lids = [np.asarray([1, 2]), np.asarray([3]), np.asarray([-1, 4])]
    rids = [np.asarray([5, 6, 7, 8]), np.asarray([-1, -1, -1, 9]), np.asarray([10])]
    check_exact_tokens(Case(local, [remote], lids, rids, 14, 14))
    geo = read_geometry(local, remote)
    with pytest.raises(BlockIdError) as exc:
        plan_pull(geo, lids, rids, 10, 14)
    assert exc.value.field == "num_tokens"
    with pytest.raises(BlockIdError) as exc:
        plan_pull(geo, lids, rids, 15, 14)
    assert exc.value.field == "num_tokens"


@pytest.mark.parametrize(
    ("lids", "field"),
    [
        ([[1], [3], [4]], "block_ids[0]"),  # 14 tokens need 2 local blocks of 8
        ([[1, 1], [3], [4]], "block_ids[0][1]"),  # repeat
        ([[1, 99], [3], [4]], "block_ids[0][1]"),  # out of range
        ([[1, 2], [3]], "block_ids"),  # a group missing
    ],
)
def test_bad_local_ids_name_the_field(lids, field):
    local, remote = _hybrid(2, 4, num_blocks=24), _hybrid(2, 2, num_blocks=24)
    rids = [[5, 6, 7, 8], [9], [10]]
    with pytest.raises(BlockIdError) as exc:
        plan_pull(read_geometry(local, remote), lids, rids, 14, 14)
    assert exc.value.field == field


# ------------------------------------------------------------------------------------------------
# Packed K|V rows (vLLM 0.33): a block unit is [heads, tokens, head_size + head_size_v], so one
# head's K is ``kernel_block_size`` runs of ``head_size`` elements, a K|V row apart.


def _unpacked(a: AttnSpec, layers: int, num_blocks: int, tp: int = 1, rank: int = 0, **kw):
    spec = replace(hybrid_spec(), mamba=None, mamba_groups=(), attn_groups=(layers,), attn=a)
    return render(spec, tp, rank, num_blocks=num_blocks, **kw)


@st.composite
def packed_cases(draw) -> Case:
    """Packed K|V on the decode, the prefill or both; independent block and kernel block sizes
    and TP 1/2/4 on each side, so rows of different kernel blocks must meet token by token."""
    heads = draw(st.sampled_from([1, 2, 4]))
    base = AttnSpec(total_heads=heads, head_size=draw(st.integers(1, 4)),
                    dtype=draw(st.sampled_from(["float32", "bfloat16", "float8_e4m3fn"])),
                    kbs=draw(st.integers(1, 4)), ratio=draw(st.integers(1, 4)),
                    head_layout="HND")  # fmt: skip
    rattn = replace(base, kbs=draw(st.integers(1, 4)), ratio=draw(st.integers(1, 4)))
    if (rattn.kbs, rattn.ratio) == (base.kbs, base.ratio):
        rattn = replace(rattn, ratio=rattn.ratio + 1)
    lpacked, rpacked = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    layers = draw(st.integers(1, 3))
    tp_l, tp_r = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    remote_tokens = draw(st.integers(1, 40))
    num_tokens = draw(st.integers(1, remote_tokens))
    lnb, rnb = -(-num_tokens // base.kbs) + 2, -(-remote_tokens // rattn.kbs) + 2

    def side(a: AttnSpec, packed: bool, nb: int, tp: int, rank: int) -> Manifest:
        return (
            render_packed(a, layers, nb, tp, rank) if packed else _unpacked(a, layers, nb, tp, rank)
        )

    local = side(base, lpacked, lnb, tp_l, draw(st.integers(0, tp_l - 1)))
    remotes = [side(rattn, rpacked, rnb, tp_r, r) for r in range(tp_r)]
    lids = _side_ids(draw, local, num_tokens, True, list(draw(st.permutations(range(lnb)))))
    rids = _side_ids(draw, remotes[0], remote_tokens, False,
                     list(draw(st.permutations(range(rnb)))))  # fmt: skip
    return Case(local, remotes, lids, rids, num_tokens, remote_tokens)


@SETTINGS
@given(packed_cases(), st.booleans())
def test_packed_kv_rows_re_block_every_token_of_every_unit_once(case, coalesce):
    assert _differs(case)
    check_exact_tokens(case, coalesce)


def test_packed_rows_coalesce_only_where_a_row_is_contiguous():
    # One head of 4 float32 elements: a packed token row is 16 bytes, 32 apart (K|V), so each
    # token's K and V is its own descriptor; the unpacked decode takes 8-token runs otherwise.
    a = AttnSpec(total_heads=1, head_size=4, dtype="float32", kbs=4, ratio=1, head_layout="HND")
    remote = render_packed(a, 1, 8)
    local = _unpacked(replace(a, kbs=8), 1, 8)
    lids, rids = [np.asarray([3])], [np.asarray([1, 5])]
    plan = plan_pull(read_geometry(local, remote), lids, rids, 8, 8)
    assert plan.num_descriptors == 2 * 8
    assert (plan.length == 16).all()
    check_exact_tokens(Case(local, [remote], lids, rids, 8, 8))
    # Packed on both sides, a head's K and V rows interleave alike: coalescing joins them back
    # into one run per prefill kernel block.
    packed = render_packed(replace(a, kbs=8), 1, 8)
    both = plan_pull(read_geometry(packed, remote), lids, rids, 8, 8)
    assert both.num_descriptors == 2
    assert (both.length == 4 * 32).all()
    check_exact_tokens(Case(packed, [remote], lids, rids, 8, 8))


def test_compare_allows_different_rows_only_when_re_blocking():
    a = AttnSpec(total_heads=2, head_size=4, dtype="bfloat16", kbs=4, ratio=2, head_layout="HND")
    assert compare_manifests(render_packed(a, 2, 8), _unpacked(replace(a, ratio=1), 2, 8)) == {}
    assert compare_manifests(render_packed(a, 2, 8), render_packed(replace(a, kbs=2), 2, 8)) == {}
    # equal block sizes pair block ids, whose pieces need the same rows on both sides
    diff = compare_manifests(render_packed(a, 2, 8), _unpacked(a, 2, 8))
    assert "groups[0].layers[0].k.rows" in diff
    # bytes per token must still agree
    diff = compare_manifests(
        render_packed(a, 2, 8), render_packed(replace(a, head_size=8, kbs=2), 2, 8)
    )
    assert "groups[0].layers[0].head_size" in diff


@pytest.mark.parametrize(
    ("model", "local_opts", "remote_opts", "sizes"),
    [
        # attention only, the decode's block twice the prefill's
        ("llama-3.1-8b", {"block_size": 32}, {"block_size": 16}, "32 vs 16"),
        # hybrid: the Mamba page shrinks with TP, so TP 4 blocks are half as long as TP 1's
        ("falcon-h1-0.5b", {"tp_size": 1}, {"tp_size": 4}, "800 vs 400"),
    ],
)
def test_re_blocking_refuses_nhd_packed_rows_naming_the_head_layout(
    model, local_opts, remote_opts, sizes
):
    cfg = load_hf_config(model)

    def nhd(**opts) -> Manifest:
        return plan_manifest(cfg, PlanOptions(num_blocks=24, head_layout="NHD", **opts))

    local, remote = nhd(**local_opts), nhd(**remote_opts)
    assert local.groups[0].layers[0].k.rows > 1  # vLLM 0.33's packed K|V rows
    with pytest.raises(IncompatiblePeerError) as exc:
        read_geometry(local, remote)
    field = "groups[0].layers[0].k.head_layout"
    assert exc.value.fields[field] == ("NHD", "NHD")
    assert all(f.endswith(".head_layout") for f in exc.value.fields)
    assert (
        f"{field}: re-blocking (block_size {sizes}) supports packed K|V rows only in the HND "
        "head layout, local='NHD' remote='NHD'"
    ) in str(exc.value)
