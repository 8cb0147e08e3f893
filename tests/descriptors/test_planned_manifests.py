"""Descriptors over the planner's real-model manifests: every requested byte, once, at any TP.

Uses :func:`kvxferd.layout.plan_manifest` (skipped where it is absent). Pages of real models are
megabytes, so coverage is checked on byte *intervals* derived from the wire rule, not per byte.
"""

from __future__ import annotations

import numpy as np
import pytest

layout = pytest.importorskip("kvxferd.layout")

from kvxferd.descriptors import build_views, desc_ids, plan_read  # noqa: E402
from kvxferd.errors import IncompatiblePeerError, ManifestError  # noqa: E402
from kvxferd.wire import AttentionLayer, Manifest  # noqa: E402

PRESETS = layout.preset_names()
NUM_BLOCKS = 6


def plan(name: str, **opts) -> Manifest:
    return layout.plan_manifest(
        layout.load_hf_config(name), layout.PlanOptions(num_blocks=NUM_BLOCKS, **opts)
    )


def plannable(name: str, opts: dict) -> bool:
    """Whether the planner lays out this preset with these options (some it refuses)."""
    try:
        plan(name, **opts)
    except ManifestError:
        return False
    return True


def request(m: Manifest) -> list[np.ndarray]:
    """Disjoint ids: one or two blocks per group, from the top of the pool downwards."""
    out, nxt = [], m.num_blocks - 1
    for g in range(len(m.groups)):
        n = 2 if g == 0 and nxt >= len(m.groups) else 1
        out.append(np.arange(nxt, nxt - n, -1, dtype=np.int64) if nxt - n + 1 >= 0 else [])
        nxt -= n
    return [np.asarray(ids, dtype=np.int64) for ids in out]


def merged(region: np.ndarray, start: np.ndarray, length: np.ndarray) -> list[tuple[int, ...]]:
    """Union of byte intervals as sorted, non-touching (region, start, end) triples."""
    order = np.lexsort((start, region))
    out: list[list[int]] = []
    for r, s, e in zip(region[order].tolist(), start[order].tolist(),
                       (start + length)[order].tolist(), strict=True):  # fmt: skip
        if out and out[-1][0] == r and s <= out[-1][2]:
            out[-1][2] = max(out[-1][2], e)
        else:
            out.append([r, s, e])
    return [tuple(x) for x in out]


def wanted(m: Manifest, ids: list[np.ndarray]) -> tuple[list[tuple[int, ...]], int]:
    """Intervals of every TP unit (every row of it) of every part of the requested blocks, and
    their byte count."""
    regs, starts, lens = [], [], []
    for group, gids in zip(m.groups, ids, strict=True):
        ratio = 1 if group.kind == "mamba" else group.block_size // group.kernel_block_size
        units = (gids[:, None] * ratio + np.arange(ratio)).ravel()
        for layer in group.layers:
            parts = [layer.k, layer.v] if isinstance(layer, AttentionLayer) else [
                *layer.conv, layer.ssm]  # fmt: skip
            for p in parts:
                s = (p.offset + units[:, None, None] * p.block_stride
                     + np.arange(p.units)[None, :, None] * p.unit_stride
                     + np.arange(p.rows)[None, None, :] * p.row_stride).ravel()  # fmt: skip
                starts.append(s)
                regs.append(np.full(s.size, layer.region))
                lens.append(np.full(s.size, p.unit_bytes))
    r, s, n = (np.concatenate(x).astype(np.int64) for x in (regs, starts, lens))
    return merged(r, s, n), int(n.sum())


OPTIONS = [{}, {"tp_size": 2, "tp_rank": 1}, {"attn_pack_size": 2}, {"cross_layer": True},
           {"head_layout": "NHD", "conv_layout": "SD"}]  # fmt: skip
CASES = [(n, o) for n in PRESETS for o in OPTIONS if plannable(n, o)]


@pytest.mark.parametrize(
    ("name", "opts"),
    CASES,
    ids=[f"{n}-{','.join(f'{k}={v}' for k, v in o.items())}" for n, o in CASES],
)
def test_plan_and_views_cover_the_request_exactly(name, opts):
    m = plan(name, **opts)
    ids = request(m)
    want, nbytes = wanted(m, ids)
    for coalesce in (False, True):
        p = plan_read(m, m, ids, ids, coalesce=coalesce)
        assert int(p.length.sum()) == nbytes == p.total_bytes
        assert merged(p.local_region, p.local_offset, p.length) == want
        assert merged(p.remote_region, p.remote_offset, p.length) == want
    views = build_views(m)
    region, offset, length = views.table()
    d = np.concatenate([desc_ids(views, g, i) for g, i in enumerate(ids)])
    assert int(length[d].sum()) == nbytes
    assert merged(region[d], offset[d], length[d]) == want


@pytest.mark.parametrize(("tp_local", "tp_remote"), [(1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("name", PRESETS)
def test_hetero_tp_fills_every_local_byte_once(name, tp_local, tp_remote):
    remote = [plan(name, tp_size=tp_remote, tp_rank=r) for r in range(tp_remote)]
    for rank in range(tp_local):
        local = plan(name, tp_size=tp_local, tp_rank=rank)
        ids = request(local)
        if local.groups[0].block_size != remote[0].groups[0].block_size:
            # hybrids size blocks per TP (the mamba state shrinks with TP); token-level
            # re-blocking is not supported, so such peers are refused, naming the field
            with pytest.raises(IncompatiblePeerError) as exc:
                plan_read(local, remote[0], ids, ids)
            assert "groups[0].block_size" in exc.value.fields
            continue
        want, nbytes = wanted(local, ids)
        plans = [plan_read(local, rm, ids, ids) for rm in remote]
        lreg = np.concatenate([p.local_region for p in plans])
        loff = np.concatenate([p.local_offset for p in plans])
        ln = np.concatenate([p.length for p in plans])
        assert int(ln.sum()) == nbytes
        assert merged(lreg, loff, ln) == want


CROSS = [n for n in PRESETS if plannable(n, {"cross_layer": True})]


@pytest.mark.parametrize("name", CROSS)
def test_cross_layer_peer_fills_a_per_layer_pool(name):
    # seed 001: one region per page size on one side, a region per layer on the other
    local, remote = plan(name), plan(name, cross_layer=True)
    ids = request(local)
    p = plan_read(local, remote, ids, ids)
    assert merged(p.local_region, p.local_offset, p.length) == wanted(local, ids)[0]
    assert merged(p.remote_region, p.remote_offset, p.length) == wanted(remote, ids)[0]


# Hybrids size blocks per TP and per attention pack: such peers re-block (tokens move).
REBLOCK = [
    ("falcon-h1-0.5b", {"tp_size": 4}, {}),
    ("qwen3-next-80b-a3b", {"tp_size": 4}, {"cross_layer": True}),
    ("qwen3.5-397b-a17b", {"attn_pack_size": 4}, {}),
    ("qwen3.5-397b-a17b", {"tp_size": 4}, {}),
    ("qwen3-next-80b-a3b", {"attn_pack_size": 4}, {"cross_layer": True}),
]


@pytest.mark.parametrize(("name", "prefill", "decode"), REBLOCK)
def test_planned_hybrids_with_different_block_sizes_re_block(name, prefill, decode):
    # Pages are megabytes: check byte totals and that no local byte is written twice (the
    # per-byte token oracle runs on small random manifests in test_reblock).
    from kvxferd.descriptors import plan_pull, read_geometry

    tp = prefill.get("tp_size", 1)
    cfg = layout.load_hf_config(name)

    def plan16(**opts) -> Manifest:  # room for a state block in each of up to 13 groups
        return layout.plan_manifest(cfg, layout.PlanOptions(num_blocks=16, **opts))

    remotes = [plan16(**{**prefill, "tp_rank": r}) for r in range(tp)]
    local = plan16(**decode)
    assert local.groups[0].block_size != remotes[0].groups[0].block_size
    n = local.groups[-1].block_size + 3  # crosses a block boundary on both sides
    lids, rids = _token_ids(local, n, top=True), _token_ids(remotes[0], n, top=False)
    plans = [plan_pull(read_geometry(local, remote), lids, rids, n, n) for remote in remotes]
    reg = np.concatenate([p.local_region for p in plans])
    off = np.concatenate([p.local_offset for p in plans])
    ln = np.concatenate([p.length for p in plans])
    kv_per_token = state = 0
    for group in local.groups:
        for layer in group.layers:
            if isinstance(layer, AttentionLayer):
                kv = [layer.k, layer.v]
                kv_per_token += (
                    sum(p.units * p.unit_bytes * p.rows for p in kv) // group.kernel_block_size
                )
            else:
                state += sum(p.units * p.unit_bytes for p in [*layer.conv, layer.ssm])
    assert sum(p.kv_bytes for p in plans) == n * kv_per_token
    assert sum(p.state_bytes for p in plans) == state
    assert int(ln.sum()) == n * kv_per_token + state
    once = merged(reg, off, ln)
    assert sum(e - s for _r, s, e in once) == int(ln.sum()), "a local byte is written twice"


def _token_ids(m: Manifest, tokens: int, top: bool) -> list[np.ndarray]:
    """Disjoint ids per group for ``tokens`` tokens at this side's block sizes (one per mamba)."""
    out, nxt = [], m.num_blocks - 1 if top else 0
    for g in m.groups:
        k = 1 if g.kind == "mamba" else -(-tokens // g.block_size)
        ids = np.arange(nxt, nxt - k, -1) if top else np.arange(nxt, nxt + k)
        nxt = nxt - k if top else nxt + k
        out.append(ids.astype(np.int64))
    return out


@pytest.mark.parametrize(
    ("name", "opts"),
    [("qwen3-8b", {}), ("qwen3-8b", {"head_layout": "NHD"}),
     ("nemotron-h-8b", {"mamba_ssm_cache_dtype": "float32"})],  # 16-token kernel blocks
)  # fmt: skip
def test_contiguous_blocks_of_packed_pages_coalesce_to_one_descriptor_per_layer(name, opts):
    # vLLM 0.33 pages interleave K and V per token: the pieces per token row must merge back
    # into one run per layer, and runs of adjacent blocks into one descriptor.
    m = plan(name, **opts)
    g = next(i for i, group in enumerate(m.groups) if group.kind == "full_attention")
    ids = [np.arange(1, 5) if i == g else np.zeros(0, np.int64) for i in range(len(m.groups))]
    p = plan_read(m, m, ids, ids, coalesce=True)
    layers = m.groups[g].layers
    assert layers[0].k.rows > 1
    assert p.num_descriptors == len(layers)
    assert set(p.length.tolist()) == {4 * m.regions[layers[0].region].page_bytes}


def test_a_half_of_the_heads_of_packed_hnd_pages_is_one_descriptor_per_layer_and_block():
    local = plan("qwen3-8b", tp_size=2, tp_rank=1)
    remote = plan("qwen3-8b")
    ids = [np.arange(1, 5)]
    p = plan_read(local, remote, ids, ids, coalesce=True)
    assert p.num_descriptors == 36 * 4  # the remote's heads 4..7 of each block are one run
    assert set(p.length.tolist()) == {local.regions[0].page_bytes}
