"""Save then load (after a restart of the store) is byte-exact for dense, Mamba2 and GDN hybrids,
across TP sizes, head layouts and kernel block sizes."""

from __future__ import annotations

import pytest

from kvxferd.layout import request_blocks
from kvxferd.pattern import verify_pattern
from tests.store.helpers import (
    DENSE,
    GDN,
    MAMBA2,
    block_ids,
    filled,
    keys,
    plan,
    poisoned,
    pool,
    store,
)

SEED = 1234


def _save(root, manifests, tokens, chunk):  # noqa: ANN001
    s = store(root, chunk)
    for m in manifests:
        regions, ids = filled(m, tokens, SEED)
        out = s.save(m, regions, ids, keys(tokens, chunk), tokens)
        assert out.chunks_saved > 0 and out.file_bytes > 0


@pytest.mark.parametrize(
    ("preset", "save_tp", "load_tp"),
    [(DENSE, 1, 1), (MAMBA2, 1, 1), (GDN, 1, 1), (DENSE, 2, 1), (MAMBA2, 2, 1), (GDN, 2, 1),
     (DENSE, 1, 2), (MAMBA2, 1, 2), (GDN, 1, 2)],
)  # fmt: skip
def test_restart_and_tp_change_load_every_byte(tmp_path, preset, save_tp, load_tp):
    probe = plan(preset, blocks=1)
    tokens, chunk = 2 * probe.groups[-1].block_size, 64
    blocks = sum(request_blocks(probe, tokens)) + 2
    _save(tmp_path, [plan(preset, save_tp, r, blocks) for r in range(save_tp)], tokens, chunk)
    for r in range(load_tp):
        m = plan(preset, load_tp, r, blocks)
        regions, ids = pool(m), block_ids(m, tokens)  # other block ids than the save's
        s = store(tmp_path, chunk)  # a fresh process: nothing in DRAM
        hit = s.lookup(m, keys(tokens, chunk), tokens)
        assert hit.matched == tokens and set(hit.per_group) == {tokens}
        out = s.load(m, regions, ids, keys(tokens, chunk), tokens)
        assert out.file_bytes > 0 and out.dram_bytes == 0
        assert out.kv_bytes > 0
        assert (out.state_bytes > 0) == (preset != DENSE)
        assert verify_pattern(m, regions, ids, SEED) is None


@pytest.mark.parametrize(("preset", "save_tp", "load_tp"), [(MAMBA2, 2, 1), (GDN, 1, 2)])
def test_sd_conv_sections_load_every_byte_across_tp(tmp_path, preset, save_tp, load_tp):
    """vLLM's default SD conv layout: each section's unit is one run per conv row; its rows in
    order are its canonical bytes, so a save at one TP size loads at another."""
    probe = plan(preset, blocks=1, conv_layout="SD")
    tokens, chunk = 2 * probe.groups[-1].block_size, 64
    blocks = sum(request_blocks(probe, tokens)) + 2
    saved = [plan(preset, save_tp, r, blocks, conv_layout="SD") for r in range(save_tp)]
    assert all(p.rows > 1 for g in saved[0].groups if g.kind == "mamba" for p in g.layers[0].conv)
    _save(tmp_path, saved, tokens, chunk)
    for r in range(load_tp):
        m = plan(preset, load_tp, r, blocks, conv_layout="SD")
        regions, ids = pool(m), block_ids(m, tokens)
        out = store(tmp_path, chunk).load(m, regions, ids, keys(tokens, chunk), tokens)
        assert out.state_bytes > 0
        assert verify_pattern(m, regions, ids, SEED) is None


def test_second_load_comes_from_dram(tmp_path):
    m = plan(MAMBA2, blocks=12)
    tokens = m.groups[0].block_size
    regions, ids = filled(m, tokens, SEED)
    s = store(tmp_path, 64)
    s.save(m, regions, ids, keys(tokens, 64), tokens)
    target = pool(m)
    out = s.load(m, target, block_ids(m, tokens), keys(tokens, 64), tokens)
    assert out.dram_bytes > 0 and out.file_bytes == 0
    assert verify_pattern(m, target, block_ids(m, tokens), SEED) is None


def _payloads(root):  # noqa: ANN001
    from kvxferd.store import format as fmt

    out = {}
    for path in sorted(root.rglob("*.kvx")):
        data = path.read_bytes()
        header, start = fmt.read_header(data, len(data))
        out[(header.key, header.chunk)] = data[start:]
    return out


@pytest.mark.parametrize(
    ("a", "b"),
    [(dict(block_size=16), dict(block_size=32)), (dict(head_layout="HND"), dict(head_layout="NHD")),
     (dict(kernel_alignment=16), dict(kernel_alignment=32)),
     (dict(kv_packing="token"), dict(kv_packing="block"))],
)  # fmt: skip
def test_canonical_bytes_do_not_depend_on_block_sizes_or_head_layout(tmp_path, a, b):
    """Save at layout A, load into layout B, save B elsewhere: identical payloads; and B's save
    loads back into A byte-exact (the pattern is checked in A's own layout)."""
    preset = DENSE if "kernel_alignment" not in a else "nemotron-h-8b"
    pa, pb = plan(preset, blocks=1, **a), plan(preset, blocks=1, **b)
    tokens = max(pa.groups[-1].block_size, pb.groups[-1].block_size) * 2
    blocks = max(sum(request_blocks(p, tokens)) for p in (pa, pb)) + 1
    ma, mb = plan(preset, blocks=blocks, **a), plan(preset, blocks=blocks, **b)
    assert (
        (ma.groups[-1].block_size, ma.groups[-1].kernel_block_size)
        != (
            mb.groups[-1].block_size,
            mb.groups[-1].kernel_block_size,
        )
        or ma.groups[-1].layers[0].head_layout != mb.groups[-1].layers[0].head_layout
        or (ma.groups[-1].layers[0].k.rows != mb.groups[-1].layers[0].k.rows)
    )
    chunk = 32
    k = keys(tokens, chunk)
    regions_a, ids_a = filled(ma, tokens, SEED)
    store(tmp_path / "a", chunk).save(ma, regions_a, ids_a, k, tokens)
    regions_b, ids_b = pool(mb), block_ids(mb, tokens)
    store(tmp_path / "a", chunk).load(mb, regions_b, ids_b, k, tokens)
    store(tmp_path / "b", chunk).save(mb, regions_b, ids_b, k, tokens)
    assert _payloads(tmp_path / "a") == _payloads(tmp_path / "b")
    back, back_ids = poisoned(ma, tokens, SEED)
    assert verify_pattern(ma, back, back_ids, SEED) is not None
    store(tmp_path / "b", chunk).load(ma, back, back_ids, k, tokens)
    assert verify_pattern(ma, back, back_ids, SEED) is None


def test_partial_last_chunk_loads_exactly_its_tokens(tmp_path):
    """A prompt that ends inside a block: the rows before its end come from the store (poisoned
    first, so a load that skipped them fails), the rows after it are never written."""
    m = plan(DENSE, blocks=8)
    tokens, chunk = 37, 16
    regions, ids = filled(m, tokens, SEED)
    store(tmp_path, chunk).save(m, regions, ids, keys(tokens, chunk), tokens)
    target, tids = poisoned(m, tokens, SEED)
    assert verify_pattern(m, target, tids, SEED) is not None
    store(tmp_path, chunk).load(m, target, tids, keys(tokens, chunk), tokens)
    assert verify_pattern(m, target, tids, SEED) is None
