"""vLLM's default SD conv state (state_len rows, each holding every channel of the rank) read
across TP sizes: each section (x|B|C, Q|K|V) is sliced by its TP unit in every row, so a byte
lands at the same (row, section, global head/group, channel byte) it left."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd.descriptors import plan_read, source_ranks
from kvxferd.descriptors.tpslice import owned_units
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.layout.models import read_geometry
from kvxferd.layout.states import mamba_state
from kvxferd.wire import DTYPE_BYTES, Manifest

# A tiny Mamba2 hybrid: 4 heads of 2 channels, 2 B/C groups of 2, conv kernel 3 (2 rows), bf16.
TINY = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4, "hidden_size": 8,
        "mamba_num_heads": 4, "mamba_head_dim": 2, "n_groups": 2, "ssm_state_size": 2,
        "conv_kernel": 3, "torch_dtype": "bfloat16"}  # fmt: skip


def _plan(hf: dict, tp: int, rank: int, block_size: int | None = None) -> Manifest:
    opts = PlanOptions(tp_size=tp, tp_rank=rank, num_blocks=4, conv_layout="SD",
                       mamba_ssm_cache_dtype="float32", block_size=block_size)  # fmt: skip
    return plan_manifest(hf, opts)


def _ids(m: Manifest, block: int) -> list[np.ndarray]:
    """Block ``block`` of every mamba group, nothing of the attention groups."""
    return [np.array([block] if g.kind == "mamba" else [], dtype=np.int64) for g in m.groups]


def _rows(plan) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, length) of each descriptor, in local order."""
    order = np.argsort(plan.local_offset, kind="stable")
    cols = (plan.local_offset[order], plan.remote_offset[order], plan.length[order])
    return [tuple(int(x) for x in t) for t in zip(*cols, strict=True)]


def test_a_tp1_decode_takes_each_row_of_a_tp2_rank_into_that_ranks_heads_and_group():
    # TP 1 row: x heads 0-3 at bytes [0, 16), B groups 0-1 at [16, 24), C at [24, 32).
    # TP 2 rank 1 row: x heads 2-3 at [0, 8), B group 1 at [8, 12), C group 1 at [12, 16).
    local, remote = _plan(TINY, 1, 0), _plan(TINY, 2, 1)
    (layer,) = local.groups[0].layers
    assert [(p.name, p.rows, p.row_stride) for p in layer.conv] == [
        ("conv_x", 2, 32), ("conv_b", 2, 32), ("conv_c", 2, 32)]  # fmt: skip
    plan = plan_read(local, remote, _ids(local, 2), _ids(remote, 1), coalesce=False)
    lb, rb = 2 * 512, 1 * 256  # the blocks' pages (conv state first)
    assert _rows(plan) == [
        (lb + 8, rb + 0, 8), (lb + 20, rb + 8, 4), (lb + 28, rb + 12, 4),  # row 0: x, B, C
        (lb + 40, rb + 16, 8), (lb + 52, rb + 24, 4), (lb + 60, rb + 28, 4),  # row 1
        (lb + 64 + 32, rb + 32, 32),  # SSM state of heads 2-3
    ]  # fmt: skip


def test_a_tp2_decode_rank_takes_its_heads_and_group_out_of_each_tp1_row():
    local, remote = _plan(TINY, 2, 1), _plan(TINY, 1, 0)
    plan = plan_read(local, remote, _ids(local, 1), _ids(remote, 2), coalesce=False)
    lb, rb = 1 * 256, 2 * 512
    assert _rows(plan) == [
        (lb + 0, rb + 8, 8), (lb + 8, rb + 20, 4), (lb + 12, rb + 28, 4),
        (lb + 16, rb + 40, 8), (lb + 24, rb + 52, 4), (lb + 28, rb + 60, 4),
        (lb + 32, rb + 64 + 32, 32),
    ]  # fmt: skip


def test_a_group_replicated_over_tp_is_read_once_from_its_first_holder():
    one = {**TINY, "n_groups": 1}  # at TP 2 every rank holds the only B/C group (vLLM's rule)
    local = _plan(one, 1, 0)
    sent = {}
    for r in range(2):
        remote = _plan(one, 2, r)
        assert [(p.name, p.units, p.units_total) for p in remote.groups[0].layers[0].conv][1:] == [
            ("conv_b", 1, 1), ("conv_c", 1, 1)]  # fmt: skip
        plan = plan_read(local, remote, _ids(local, 2), _ids(remote, 1), coalesce=False)
        sent[r] = int(plan.length.sum())
    # rank 0: its 2 heads, B and C and SSM; rank 1: its 2 heads and SSM only
    row = (2 * 2 + 2) * 2
    assert sent == {0: 2 * (row + 4) + 32, 1: 2 * (2 * 2 * 2) + 32}


def _channel_keys(m: Manifest, hf: dict) -> np.ndarray:
    """(row, section, global unit, byte in unit) of every byte of this rank's SD conv state of
    one block, from the model's geometry alone (no Part arithmetic), as one int64 key per byte."""
    layer = next(g for g in m.groups if g.kind == "mamba").layers[0]
    size = DTYPE_BYTES[layer.conv_dtype]
    state = mamba_state(read_geometry(hf).mamba, m.tp_size, 0)
    keys = []
    for row in range(layer.conv_shape[0]):
        for s, sec in enumerate(state.sections):
            first = owned_units(sec.units_total, m.tp_size, m.tp_rank).start
            unit = np.repeat(np.arange(sec.units) + first, sec.unit_channels * size)
            byte = np.tile(np.arange(sec.unit_channels * size), sec.units)
            keys.append(((row * 8 + s) << 40) + (unit << 20) + byte)
    out = np.concatenate(keys)
    assert out.size == layer.conv_shape[0] * layer.conv_shape[1] * size
    return out


@pytest.mark.parametrize("name", ["nemotron-h-8b", "granite-4.0-h-tiny", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize(("ltp", "rtp"), [(1, 2), (2, 1), (4, 2), (1, 4)])
def test_every_conv_byte_comes_from_the_same_row_section_unit_and_byte(name, ltp, rtp):
    hf = load_hf_config(name)
    for lr in range(ltp):
        local = _plan(hf, ltp, lr, 2048)  # one block size at every TP: block ids pair up
        lkeys = _channel_keys(local, hf)
        g = next(i for i, grp in enumerate(local.groups) if grp.kind == "mamba")
        lpage = local.groups[g].layers[0].ssm.block_stride
        conv_end = lkeys.size  # the conv state opens the page
        got = np.full(conv_end, -1, dtype=np.int64)
        for rr in source_ranks(local, rtp):
            remote = _plan(hf, rtp, rr, 2048)
            rkeys = _channel_keys(remote, hf)
            rpage = remote.groups[g].layers[0].ssm.block_stride
            ids = [
                np.array([1] if i == g else [], dtype=np.int64) for i in range(len(local.groups))
            ]
            plan = plan_read(local, remote, ids, ids, coalesce=False)
            first = plan.local_region == local.groups[g].layers[0].region
            cols = (plan.local_offset[first], plan.remote_offset[first], plan.length[first])
            for lo, ro, n in zip(*cols, strict=True):
                lo, ro = int(lo) - lpage, int(ro) - rpage
                if lo >= conv_end:
                    continue  # the SSM state
                assert (got[lo : lo + n] == -1).all(), "a conv byte is written twice"
                got[lo : lo + n] = rkeys[ro : ro + n]
        np.testing.assert_array_equal(got, lkeys)
