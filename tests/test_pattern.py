"""The KV content pattern: deterministic, block-exact, and the same bytes across TP layouts."""

from __future__ import annotations

import numpy as np
import pytest

from kvxferd import pattern
from kvxferd.errors import BlockIdError, ManifestError, MemoryRegionError
from kvxferd.pattern import Mismatch, verify_pattern, write_pattern
from kvxferd.wire import AttentionLayer, Group, MambaLayer, Manifest, Part, Region

SENTINEL = 0xA5


def part(name, offset, block_stride, units, unit_bytes, units_total, sliceable=True):
    return Part(
        name=name,
        offset=offset,
        block_stride=block_stride,
        units=units,
        unit_bytes=unit_bytes,
        unit_stride=unit_bytes,
        units_total=units_total,
        sliceable=sliceable,
    )


def attention(name, index, region, k, v, heads, total, layout="HND", order="blocks_first"):
    return AttentionLayer(
        name=name,
        index=index,
        region=region,
        num_kv_heads=heads,
        total_kv_heads=total,
        head_size=4,
        dtype="float16",
        head_layout=layout,
        kv_order=order,
        k=k,
        v=v,
    )


def hybrid(tp_size=1, tp_rank=0, num_blocks=8):
    """One region of 256-byte pages shared by an FA layer (group 0) and a mamba layer (group 1).

    FA: logical blocks of 8 tokens = 2 kernel blocks of 4 tokens; per kernel block (128 bytes
    at TP1) [K | V], each HND: 2 heads x (4 tokens x 4 elems x 2 bytes = 32 bytes).
    Mamba (DS conv): conv_x 4 channels, conv_b 2, conv_c 2, 6 bytes each (state_len 3 fp16);
    ssm 2 heads of 32 bytes; then padding up to the page size.
    """
    heads = 2 // tp_size
    kv = heads * 32
    page = 256
    k = part("k", 0, 2 * kv, heads, 32, 2)
    v = part("v", kv, 2 * kv, heads, 32, 2)
    x, bc, ssm_heads = 4 // tp_size, 2 // tp_size, 2 // tp_size
    conv = [
        part("conv_x", 0, page, x, 6, 4),
        part("conv_b", 6 * x, page, bc, 6, 2),
        part("conv_c", 6 * x + 6 * bc, page, bc, 6, 2),
    ]
    ssm = part("ssm", 48, page, ssm_heads, 32, 2)
    mamba = MambaLayer(
        name="model.layers.1.mixer",
        index=1,
        region=0,
        mamba_type="mamba2",
        conv_shape=[x + 2 * bc, 3],
        conv_dtype="float16",
        ssm_shape=[ssm_heads, 4, 4],
        ssm_dtype="float16",
        conv_layout="DS",
        conv=conv,
        ssm=ssm,
    )
    return Manifest(
        model="tiny-hybrid",
        num_blocks=num_blocks,
        regions=[
            Region(name="r0", size_bytes=num_blocks * page, num_blocks=num_blocks, page_bytes=page)
        ],
        groups=[
            Group(
                kind="full_attention",
                block_size=8,
                kernel_block_size=4,
                layers=[attention("model.layers.0.attn", 0, 0, k, v, heads, 2)],
            ),
            Group(kind="mamba", block_size=8, kernel_block_size=8, layers=[mamba]),
        ],
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


def dense_kv_first(num_blocks=6):
    """Two NHD layers, each its own region: all K blocks (512 bytes each), then all V blocks."""
    kb = 512
    layers = [
        attention(
            f"model.layers.{i}.attn",
            i,
            i,
            part("k", 0, kb, 1, kb, 1, sliceable=False),
            part("v", num_blocks * kb, kb, 1, kb, 1, sliceable=False),
            2,
            2,
            layout="NHD",
            order="kv_first",
        )
        for i in range(2)
    ]
    return Manifest(
        model="tiny-dense",
        num_blocks=num_blocks,
        regions=[
            Region(
                name=f"r{i}", size_bytes=2 * num_blocks * kb, num_blocks=num_blocks, page_bytes=kb
            )
            for i in range(2)
        ],
        groups=[Group(kind="full_attention", block_size=16, kernel_block_size=16, layers=layers)],
    )


def parts_of(layer):
    if isinstance(layer, AttentionLayer):
        return [layer.k, layer.v]
    return [*layer.conv, layer.ssm]


def alloc(manifest, fill=SENTINEL):
    return [np.full(r.size_bytes, fill, dtype=np.uint8) for r in manifest.regions]


def test_write_then_verify_hybrid_and_dense():
    for manifest, ids in ((hybrid(), [[3, 5], [6]]), (dense_kv_first(), [[4, 0, 2]])):
        regions = alloc(manifest)
        write_pattern(manifest, regions, ids, seed=11)
        assert verify_pattern(manifest, regions, ids, seed=11) is None
        assert verify_pattern(manifest, alloc(manifest), ids, seed=11) is not None


def test_flipped_byte_is_reported_exactly():
    manifest = hybrid()
    ids = [[3, 5], [6]]
    # FA block 5, kernel sub-block 1, V part, head 1, byte 3.
    fa_addr = (5 * 2 + 1) * 128 + 64 + 32 + 3
    # Mamba block 6, ssm head 1, byte 5.
    ssm_addr = 6 * 256 + 48 + 32 + 5
    for addr, want in (
        (fa_addr, dict(group=0, layer="model.layers.0.attn", block=5, part="v", offset=35)),
        (ssm_addr, dict(group=1, layer="model.layers.1.mixer", block=6, part="ssm", offset=37)),
    ):
        regions = alloc(manifest)
        write_pattern(manifest, regions, ids, seed=3)
        good = int(regions[0][addr])
        regions[0][addr] ^= 0xFF
        found = verify_pattern(manifest, regions, ids, seed=3)
        assert found == Mismatch(
            **want,
            expected=good,
            actual=good ^ 0xFF,
            sub_block=1 if want["part"] == "v" else 0,
            region=0,
            address=addr,
        )


def test_writes_only_the_listed_blocks_and_never_mamba_padding():
    manifest = hybrid()
    regions = alloc(manifest)
    write_pattern(manifest, regions, [[3, 5], [6]], seed=5)
    written = np.zeros(manifest.regions[0].size_bytes, dtype=bool)
    written[3 * 256 : 4 * 256] = True  # FA pages are fully used by K and V
    written[5 * 256 : 6 * 256] = True
    written[6 * 256 : 6 * 256 + 112] = True  # conv 48 bytes + ssm 64 bytes; the rest is padding
    assert (regions[0][~written] == SENTINEL).all()
    # Every written byte is pattern, and (1 in 256 by chance) rarely the sentinel.
    assert (regions[0][written] == SENTINEL).mean() < 0.05


def test_kv_first_blocks_are_independent():
    manifest = dense_kv_first()
    regions = alloc(manifest)
    write_pattern(manifest, regions, [[2]], seed=1)
    for region in regions:
        touched = np.flatnonzero(region != SENTINEL)
        k_block, v_block = 2 * 512, 6 * 512 + 2 * 512
        inside = ((touched >= k_block) & (touched < k_block + 512)) | (
            (touched >= v_block) & (touched < v_block + 512)
        )
        assert inside.all() and touched.size > 900


def _unit_bytes(manifest, regions, g, layer_i, part_name, logical, sub, gunit):
    """The bytes of global TP unit ``gunit`` of a part, addressed straight from the manifest."""
    group = manifest.groups[g]
    layer = group.layers[layer_i]
    p = {pp.name: pp for pp in parts_of(layer)}[part_name]
    ratio = group.block_size // group.kernel_block_size if isinstance(layer, AttentionLayer) else 1
    per_rank = p.units_total // manifest.tp_size
    local = gunit - manifest.tp_rank * per_rank
    assert 0 <= local < p.units
    start = p.offset + (logical * ratio + sub) * p.block_stride + local * p.unit_stride
    return regions[layer.region][start : start + p.unit_bytes]


def test_tp2_ranks_carry_the_tp1_bytes_of_their_heads_and_states():
    full = hybrid(tp_size=1)
    ranks = [hybrid(tp_size=2, tp_rank=r) for r in range(2)]
    full_ids = [[1, 2], [7]]
    rank_ids = [[[4, 0], [3]], [[6, 5], [2]]]  # each rank's physical ids differ
    full_regions = alloc(full)
    write_pattern(full, full_regions, full_ids, seed=42)
    rank_regions = []
    for manifest, ids in zip(ranks, rank_ids, strict=True):
        regions = alloc(manifest)
        write_pattern(manifest, regions, ids, seed=42)
        rank_regions.append(regions)
    compared = 0
    for g, layer_i, name, ratio in (
        (0, 0, "k", 2),
        (0, 0, "v", 2),
        (1, 0, "conv_x", 1),
        (1, 0, "conv_b", 1),
        (1, 0, "conv_c", 1),
        (1, 0, "ssm", 1),
    ):
        p = {pp.name: pp for pp in parts_of(full.groups[g].layers[layer_i])}[name]
        for ordinal, logical in enumerate(full_ids[g]):
            for sub in range(ratio):
                for gunit in range(p.units_total):
                    r = gunit // (p.units_total // 2)
                    want = _unit_bytes(full, full_regions, g, layer_i, name, logical, sub, gunit)
                    got = _unit_bytes(
                        ranks[r], rank_regions[r], g, layer_i, name, rank_ids[r][g][ordinal],
                        sub, gunit,
                    )  # fmt: skip
                    np.testing.assert_array_equal(got, want)
                    compared += 1
    assert compared == 2 * 2 * 2 * 2 + 4 + 2 + 2 + 2


def test_replicated_unit_is_identical_on_every_rank():
    """One KV head at TP2: both ranks hold head 0 and so carry the same bytes."""

    def replicated(rank):
        k = part("k", 0, 64, 1, 32, 1)
        v = part("v", 32, 64, 1, 32, 1)
        return Manifest(
            model="mqa",
            num_blocks=4,
            regions=[Region(name="r", size_bytes=256, num_blocks=4, page_bytes=64)],
            groups=[
                Group(
                    kind="full_attention",
                    block_size=4,
                    kernel_block_size=4,
                    layers=[attention("a", 0, 0, k, v, 1, 1)],
                )
            ],
            tp_size=2,
            tp_rank=rank,
        )

    regions = [alloc(replicated(r)) for r in range(2)]
    for r in range(2):
        write_pattern(replicated(r), regions[r], [[1, 2]], seed=9)
    np.testing.assert_array_equal(regions[0][0], regions[1][0])
    assert verify_pattern(replicated(1), regions[0], [[1, 2]], seed=9) is None


def test_different_seeds_give_different_bytes():
    manifest = hybrid()
    ids = [[3, 5], [6]]
    a, b = alloc(manifest), alloc(manifest)
    write_pattern(manifest, a, ids, seed=1)
    write_pattern(manifest, b, ids, seed=2)
    assert verify_pattern(manifest, a, ids, seed=2) is not None
    written = a[0] != SENTINEL
    assert (a[0][written] == b[0][written]).mean() < 0.05


def test_block_order_is_part_of_the_content():
    manifest = hybrid()
    regions = alloc(manifest)
    write_pattern(manifest, regions, [[3, 5], [6]], seed=4)
    found = verify_pattern(manifest, regions, [[5, 3], [6]], seed=4)
    assert found is not None and (found.group, found.block) == (0, 5)
    # A skipped slot (-1) keeps the ordinals of the blocks after it.
    write_pattern(manifest, regions, [[-1, 2], [6]], seed=4)
    assert verify_pattern(manifest, regions, [[-1, 2], [6]], seed=4) is None
    assert verify_pattern(manifest, regions, [[2], [6]], seed=4) is not None


def test_chunked_generation_matches_and_locates(monkeypatch):
    manifest = hybrid(num_blocks=64)
    ids = [list(range(0, 64, 2)), list(range(1, 64, 2))]
    whole = alloc(manifest)
    write_pattern(manifest, whole, ids, seed=8)
    monkeypatch.setattr(pattern, "_CHUNK_BYTES", 300)  # one or two blocks per numpy pass
    chunked = alloc(manifest)
    write_pattern(manifest, chunked, ids, seed=8)
    np.testing.assert_array_equal(chunked[0], whole[0])
    addr = 61 * 256 + 48  # mamba block 61 (ordinal 30), ssm byte 0
    chunked[0][addr] ^= 1
    found = verify_pattern(manifest, chunked, ids, seed=8)
    assert found is not None and (found.group, found.block, found.part, found.offset) == (
        1,
        61,
        "ssm",
        0,
    )


@pytest.mark.parametrize(
    ("ids", "field"),
    [
        ([[3, 8], [6]], "block_ids[0][1]"),
        ([[3], [-2]], "block_ids[1][0]"),
        ([[3, 4, 3], [6]], "block_ids[0][2]"),
        ([[3]], "block_ids"),
    ],
)
def test_bad_block_ids_name_the_field(ids, field):
    manifest = hybrid()
    with pytest.raises(BlockIdError) as err:
        write_pattern(manifest, alloc(manifest), ids, seed=0)
    assert err.value.field == field


def test_regions_must_match_the_manifest():
    manifest = hybrid()
    with pytest.raises(MemoryRegionError, match="regions"):
        write_pattern(manifest, [], [[1], [2]], seed=0)
    with pytest.raises(MemoryRegionError, match=r"regions\[0\]"):
        write_pattern(manifest, [np.zeros(100, np.uint8)], [[1], [2]], seed=0)
    with pytest.raises(MemoryRegionError, match=r"regions\[0\]"):
        write_pattern(manifest, [np.zeros(2048, np.uint16)], [[1], [2]], seed=0)


def test_part_outside_its_region_is_a_manifest_error():
    good = hybrid()
    small = Manifest(
        model=good.model,
        num_blocks=good.num_blocks,
        regions=[Region(name="r0", size_bytes=1024, num_blocks=8, page_bytes=256)],
        groups=good.groups,
    )
    with pytest.raises(ManifestError) as err:
        write_pattern(small, [np.zeros(1024, np.uint8)], [[5], []], seed=0)
    assert err.value.field == "groups[0].layers[0].k"


def test_tp_split_that_does_not_divide_is_a_manifest_error():
    manifest = hybrid(tp_size=2)
    bad = Manifest(
        model="x",
        num_blocks=8,
        regions=manifest.regions,
        groups=[manifest.groups[0]],
        tp_size=3,
    )
    with pytest.raises(ManifestError) as err:
        write_pattern(bad, alloc(bad), [[1]], seed=0)
    assert err.value.field == "groups[0].layers[0].k.units_total"
