"""Valid random manifests, built straight from the wire types (independent of the planner).

A ``ModelSpec`` is a model-level description (head counts, mamba sections, group sizes, pool
layout); :func:`render` lays it out for one TP rank the way vLLM pools memory: region ``i`` holds
layer ``i`` of every group (attention layer ``j`` in region ``j // pack`` at pack slot
``j % pack``), logical block ``L`` spans ``[L * page, (L + 1) * page)`` of every region, and an
attention page is ``ratio`` kernel blocks of ``[pack0 K|V][pack1 K|V]...`` plus padding. Dense
models may instead be K/V-first (all K kernel blocks, then all V).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.wire import (
    DTYPE_BYTES,
    AttentionLayer,
    Group,
    MambaLayer,
    Manifest,
    Part,
    Region,
)

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


@dataclass(frozen=True)
class AttnSpec:
    total_heads: int
    head_size: int
    dtype: str
    kbs: int
    ratio: int
    head_layout: str


@dataclass(frozen=True)
class MambaSpec:
    mamba_type: str
    conv_layout: str
    sections: tuple[tuple[str, int, int], ...]  # (name, units_total, channels per unit)
    conv_rows: int
    conv_dtype: str
    ssm_units_total: int
    ssm_unit_elems: int
    ssm_dtype: str
    ssm_gap: int


@dataclass(frozen=True)
class ModelSpec:
    attn: AttnSpec | None
    attn_groups: tuple[int, ...]  # layer counts: full attention, then sliding window groups
    pack: int
    kv_order: str
    mamba: MambaSpec | None
    mamba_groups: tuple[int, ...]
    pad: int
    num_blocks: int


def _n(units_total: int, tp: int, rank: int) -> range:
    """TP units of a rank: an even split, or one replicated unit when tp > units_total."""
    if units_total % tp == 0:
        n = units_total // tp
        return range(rank * n, (rank + 1) * n)
    u = rank * units_total // tp
    return range(u, u + 1)


def render(
    spec: ModelSpec,
    tp_size: int = 1,
    tp_rank: int = 0,
    *,
    num_blocks: int | None = None,
    kv_order: str | None = None,
    pack: int | None = None,
) -> Manifest:
    """The manifest of ``spec`` on one TP rank (optionally with another pool size or layout)."""
    nb = num_blocks or spec.num_blocks
    kv_order = kv_order or spec.kv_order
    pack = pack or spec.pack
    a, m = spec.attn, spec.mamba
    ratio = a.ratio if a else 1
    kv_half = head_bytes = heads = 0
    if a:
        heads = len(_n(a.total_heads, tp_size, tp_rank))
        head_bytes = a.kbs * a.head_size * DTYPE_BYTES[a.dtype]
        kv_half = heads * head_bytes  # K (or V) of one layer in one kernel block
    conv_parts: list[tuple[str, int, int, int]] = []  # name, units, unit_bytes, units_total
    conv_bytes = ssm_bytes = ssm_units = ssm_unit = 0
    if m:
        cdt = DTYPE_BYTES[m.conv_dtype]
        for name, ut, ch in m.sections:
            conv_parts.append((name, len(_n(ut, tp_size, tp_rank)), ch * m.conv_rows * cdt, ut))
        conv_bytes = sum(u * b for _n_, u, b, _t in conv_parts)
        ssm_units = len(_n(m.ssm_units_total, tp_size, tp_rank))
        ssm_unit = m.ssm_unit_elems * DTYPE_BYTES[m.ssm_dtype]
        ssm_bytes = ssm_units * ssm_unit + (ssm_units - 1) * m.ssm_gap
    mamba_bytes = conv_bytes + ssm_bytes
    kv_first = a is not None and kv_order == "kv_first" and m is None
    if kv_first:
        kstride = pack * kv_half  # K kernel blocks, then V kernel blocks
        page = ratio * 2 * kstride
    else:
        kstride = max(pack * 2 * kv_half, -(-mamba_bytes // ratio)) + spec.pad
        page = ratio * kstride if a else mamba_bytes + spec.pad
    n_attn = max(spec.attn_groups, default=0)
    n_regions = max([-(-n_attn // pack)] + list(spec.mamba_groups) + [1])
    regions = [
        Region(name=f"r{i}", size_bytes=nb * page, num_blocks=nb, page_bytes=page)
        for i in range(n_regions)
    ]
    groups, index = [], 0
    for gi, count in enumerate(spec.attn_groups):
        layers = []
        for j in range(count):
            slot = j % pack
            if kv_first:
                k_off = slot * kv_half
                v_off = nb * ratio * kstride + k_off
            else:
                k_off = slot * 2 * kv_half
                v_off = k_off + kv_half

            def part(name: str, off: int) -> Part:
                return Part(
                    name=name,
                    offset=off,
                    block_stride=kstride,
                    units=heads,
                    unit_bytes=head_bytes,
                    unit_stride=head_bytes,
                    units_total=a.total_heads,
                    sliceable=a.head_layout == "HND",
                )

            layers.append(
                AttentionLayer(
                    name=f"model.layers.{index}.self_attn",
                    index=index,
                    region=j // pack,
                    num_kv_heads=heads,
                    total_kv_heads=a.total_heads,
                    head_size=a.head_size,
                    dtype=a.dtype,
                    head_layout=a.head_layout,
                    kv_order="kv_first" if kv_first else "blocks_first",
                    pack_index=slot,
                    k=part("k", k_off),
                    v=part("v", v_off),
                )
            )
            index += 1
        groups.append(
            Group(
                kind="full_attention" if gi == 0 else "sliding_window",
                block_size=a.kbs * ratio,
                kernel_block_size=a.kbs,
                layers=layers,
                sliding_window=None if gi == 0 else 4 * gi,
            )
        )
    for count in spec.mamba_groups:
        layers = []
        for i in range(count):
            layers.append(_mamba_layer(m, index, i, page, conv_parts, conv_bytes, ssm_units))
            index += 1
        bs = a.kbs * ratio if a else 1
        groups.append(Group(kind="mamba", block_size=bs, kernel_block_size=bs, layers=layers))
    return Manifest(
        model="random",
        num_blocks=nb,
        regions=regions,
        groups=groups,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attn_pack_size=pack,
    )


def _mamba_layer(m, index, region, page, conv_parts, conv_bytes, ssm_units) -> MambaLayer:
    ssm_unit = m.ssm_unit_elems * DTYPE_BYTES[m.ssm_dtype]
    channels = sum(
        u * (b // (m.conv_rows * DTYPE_BYTES[m.conv_dtype])) for _, u, b, _t in conv_parts
    )
    if m.conv_layout == "DS":
        conv, off = [], 0
        for name, units, ub, ut in conv_parts:
            conv.append(
                Part(
                    name=name,
                    offset=off,
                    block_stride=page,
                    units=units,
                    unit_bytes=ub,
                    unit_stride=ub,
                    units_total=ut,
                )
            )
            off += units * ub
        shape = [channels, m.conv_rows]
    else:  # SD: one opaque part, sharded like the x section
        _name, units, _ub, ut = conv_parts[0]
        conv = [
            Part(
                name="conv",
                offset=0,
                block_stride=page,
                units=units,
                unit_bytes=conv_bytes // units,
                unit_stride=conv_bytes // units,
                units_total=ut,
                sliceable=False,
            )
        ]
        shape = [m.conv_rows, channels]
    ssm = Part(
        name="ssm",
        offset=conv_bytes,
        block_stride=page,
        units=ssm_units,
        unit_bytes=ssm_unit,
        unit_stride=ssm_unit + m.ssm_gap,
        units_total=m.ssm_units_total,
    )
    return MambaLayer(
        name=f"model.layers.{index}.mixer", index=index, region=region,
        mamba_type=m.mamba_type, conv_shape=shape, conv_dtype=m.conv_dtype,
        ssm_shape=[ssm_units, m.ssm_unit_elems], ssm_dtype=m.ssm_dtype,
        conv_layout=m.conv_layout, conv=conv, ssm=ssm,
    )  # fmt: skip


def num_groups(spec: ModelSpec) -> int:
    """Groups a rendered manifest of ``spec`` has."""
    return len(spec.attn_groups) + len(spec.mamba_groups)


def hybrid_spec() -> ModelSpec:
    """A small fixed hybrid: 4 KV heads, ratio 2, 2 attention layers, 2 mamba2 groups of 2."""
    return ModelSpec(
        attn=AttnSpec(total_heads=4, head_size=4, dtype="bfloat16", kbs=2, ratio=2,
                      head_layout="HND"),
        attn_groups=(2,),
        pack=1,
        kv_order="blocks_first",
        mamba=MambaSpec(mamba_type="mamba2", conv_layout="DS",
                        sections=(("conv_x", 4, 2), ("conv_b", 2, 1), ("conv_c", 2, 1)),
                        conv_rows=3, conv_dtype="bfloat16", ssm_units_total=4, ssm_unit_elems=4,
                        ssm_dtype="float32", ssm_gap=0),
        mamba_groups=(2, 2),
        pad=16,
        num_blocks=20,
    )  # fmt: skip


def render_packed(
    a: AttnSpec, layers: int, num_blocks: int, tp: int = 1, rank: int = 0
) -> Manifest:
    """An attention-only manifest in vLLM 0.33's packed layout, one region per layer."""
    hb = a.head_size * DTYPE_BYTES[a.dtype]
    heads = max(1, a.total_heads // tp)
    kstride = heads * a.kbs * 2 * hb
    page = a.ratio * kstride
    nb = num_blocks

    def part(name: str, off: int) -> Part:
        return Part(name=name, offset=off, block_stride=kstride, units=heads, unit_bytes=hb,
                    unit_stride=a.kbs * 2 * hb, units_total=a.total_heads, rows=a.kbs,
                    row_stride=2 * hb)  # fmt: skip

    return Manifest(
        model="random",
        num_blocks=nb,
        regions=[
            Region(name=f"r{i}", size_bytes=nb * page, num_blocks=nb, page_bytes=page)
            for i in range(layers)
        ],  # fmt: skip
        groups=[
            Group(
                kind="full_attention",
                block_size=a.kbs * a.ratio,
                kernel_block_size=a.kbs,
                layers=[
                    AttentionLayer(
                        name=f"model.layers.{i}.self_attn",
                        index=i,
                        region=i,
                        num_kv_heads=heads,
                        total_kv_heads=a.total_heads,
                        head_size=a.head_size,
                        dtype=a.dtype,
                        head_layout="HND",
                        kv_order="blocks_first",
                        k=part("k", 0),
                        v=part("v", hb),
                    )
                    for i in range(layers)
                ],  # fmt: skip
            )
        ],
        tp_rank=rank,
        tp_size=tp,
    )
