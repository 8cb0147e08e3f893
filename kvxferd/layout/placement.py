"""Byte placement: where each layer's K/V or conv/SSM parts sit inside the pooled regions.

Input is the planner's unified geometry and its groups (slots of layers); output is the wire
Regions and Groups. All offsets follow the addressing rule in :mod:`kvxferd.wire`.

Attention pages follow vLLM 0.33 (``kv_packing="token"``): one kernel block of one layer is
``[heads, tokens, K|V]`` (HND, ``LBHNC``) or ``[tokens, heads, K|V]`` (NHD, ``LBNHC``), K and V
of a head packed per token; cross-layer pools are ``BLHNC``/``BLNHC``, or ``BHLNC`` (heads
outer) for HND under TP. ``kv_packing="block"`` keeps the older reading (K then V per kernel
block, or all K then all V with ``kv_first``) for engines that still lay pages out that way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from kvxferd.layout.models import LayerKind, LayerSpec, ModelGeometry
from kvxferd.layout.states import MambaState
from kvxferd.wire import (
    DTYPE_BYTES,
    AttentionLayer,
    ConvLayout,
    Group,
    HeadLayout,
    KVOrder,
    Layer,
    MambaLayer,
    Part,
    Region,
)

KVPacking = Literal["token", "block"]
"""How an attention page holds K and V: per token (vLLM 0.33) or per kernel block (older)."""


@dataclass(frozen=True)
class Placement:
    """Everything placement needs; sizes are per rank, ``page_bytes`` per layer slot."""

    geom: ModelGeometry
    kv_dtype: str
    conv_dtype: str
    ssm_dtype: str
    state: MambaState | None
    block_size: int
    kernel_block_size: int
    page_bytes: int
    slots: int  # pooled tensors per page (vLLM's group_size)
    num_blocks: int
    tp_size: int
    tp_rank: int
    pack: int
    cross_layer: bool
    head_layout: HeadLayout
    conv_layout: ConvLayout
    kv_order: KVOrder
    engine_id: str
    kv_packing: KVPacking = "token"

    @property
    def ratio(self) -> int:
        """Kernel blocks per logical block."""
        return self.block_size // self.kernel_block_size

    @property
    def block_stride(self) -> int:
        """Bytes between consecutive logical blocks of one region."""
        return self.slots * self.page_bytes if self.cross_layer else self.page_bytes


def _run(name: str, offset: int, stride: int, units: int, unit: int, total: int) -> Part:
    """A part whose units are back to back (``unit_stride == unit_bytes``)."""
    return Part(
        name=name,
        offset=offset,
        block_stride=stride,
        units=units,
        unit_bytes=unit,
        unit_stride=unit,
        units_total=total,
    )


def _slug(text: str) -> str:
    tail = text.rstrip("/").rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9.]+", "-", tail).strip("-")[:48] or "model"


def _regions(p: Placement) -> list[Region]:
    prefix = f"kvxferd-{_slug(p.engine_id or p.geom.name)}-r{p.tp_rank}"
    count = 1 if p.cross_layer else p.slots
    return [
        Region(
            name=f"{prefix}-{i}",
            size_bytes=p.num_blocks * p.block_stride,
            num_blocks=p.num_blocks,
            page_bytes=p.block_stride,
        )
        for i in range(count)
    ]


def _attention_layer(p: Placement, spec: LayerSpec, slot: int, pack_index: int) -> AttentionLayer:
    if p.kv_packing == "block":
        return _block_attention_layer(p, spec, slot, pack_index)
    attn = p.geom.attention
    assert attn is not None  # the reader gives every attention-holding model its geometry
    es = DTYPE_BYTES[p.kv_dtype]
    heads = max(1, attn.num_kv_heads // p.tp_size)
    row = 2 * attn.head_size * es  # one head's [K | V] of one token
    head_page = p.kernel_block_size * row  # one head, one kernel block
    kpage = heads * head_page  # one layer, one kernel block
    if p.head_layout == "HND":
        unit_stride, row_stride = head_page, row
    else:  # NHD: a token's heads side by side, so a head is one run per token
        unit_stride, row_stride = row, heads * row
    if p.cross_layer and p.head_layout == "HND" and p.tp_size > 1:
        # BHLNC (blocks, H, L, kbs, K|V): head h of slot l at (h*L + l) * head_page.
        offset, stride = slot * head_page, heads * p.slots * head_page
        unit_stride = p.slots * head_page
    elif p.cross_layer:
        # BLHNC / BLNHC (blocks, L, page): slot l at l*page; inside it the pack's kernel pages.
        offset, stride = slot * p.page_bytes + pack_index * kpage, p.slots * p.page_bytes
    else:
        # LBHNC / LBNHC: kernel block kb at kb*pack*kpage holds [pack 0][pack 1]...
        offset, stride = pack_index * kpage, p.pack * kpage

    def part(name: str, at: int) -> Part:
        return Part(
            name=name,
            offset=at,
            block_stride=stride,
            units=heads,
            unit_bytes=attn.head_size * es,
            unit_stride=unit_stride,
            units_total=attn.num_kv_heads,
            rows=p.kernel_block_size,
            row_stride=row_stride,
        )

    k, v = part("k", offset), part("v", offset + attn.head_size * es)
    return _layer(p, spec, slot, pack_index, heads, "blocks_first", k, v)


def _block_attention_layer(
    p: Placement, spec: LayerSpec, slot: int, pack_index: int
) -> AttentionLayer:
    """The older page: K then V of all local heads per kernel block (or kv_first)."""
    attn = p.geom.attention
    assert attn is not None  # the reader gives every attention-holding model its geometry
    heads = max(1, attn.num_kv_heads // p.tp_size)
    head_bytes = p.kernel_block_size * attn.head_size * DTYPE_BYTES[p.kv_dtype]  # 1 head, 1 kb
    piece = heads * head_bytes  # K (or V) of all local heads in one kernel block
    unit_stride = head_bytes
    if p.cross_layer and p.head_layout == "HND" and p.tp_size > 1:
        # (num_blocks, H, L, [K_h | V_h]): head h of slot l at h*L*ph + l*ph, ph = 2*head_bytes.
        per_head = 2 * head_bytes
        k_off, stride, unit_stride = slot * per_head, heads * p.slots * per_head, p.slots * per_head
        v_off = k_off + head_bytes
    elif p.cross_layer:
        # (num_blocks, L, page): slot l at l*page; inside it the pack's [K | V] pieces.
        k_off, stride = slot * p.page_bytes + pack_index * 2 * piece, p.slots * p.page_bytes
        v_off = k_off + piece
    elif p.kv_order == "kv_first":
        # (2, Nk, ...): K of kernel block kb at kb*piece, V at Nk*piece + kb*piece.
        k_off, stride = 0, piece
        v_off = p.num_blocks * p.ratio * piece
    else:
        # Blocks-first: kernel block kb at kb*pack*2*piece holds [pack0 K|V][pack1 K|V]...
        k_off, stride = pack_index * 2 * piece, p.pack * 2 * piece
        v_off = k_off + piece

    def part(name: str, offset: int) -> Part:
        if p.head_layout == "HND":  # (H, kbs, D): each head's tokens contiguous
            return Part(
                name=name,
                offset=offset,
                block_stride=stride,
                units=heads,
                unit_bytes=head_bytes,
                unit_stride=unit_stride,
                units_total=attn.num_kv_heads,
            )
        # NHD (kbs, H, D): heads interleave per token, so the piece is one indivisible unit:
        # the rank's shard. Shards across ranks = tp, or the head count when heads replicate.
        return Part(
            name=name,
            offset=offset,
            block_stride=stride,
            units=1,
            unit_bytes=piece,
            unit_stride=piece,
            units_total=min(p.tp_size, attn.num_kv_heads),
            sliceable=False,
        )

    return _layer(p, spec, slot, pack_index, heads, p.kv_order, part("k", k_off), part("v", v_off))


def _layer(p: Placement, spec: LayerSpec, slot: int, pack_index: int, heads: int, kv_order: str,
           k: Part, v: Part) -> AttentionLayer:  # fmt: skip
    """One attention layer of this rank from its K and V parts."""
    attn = p.geom.attention
    assert attn is not None
    return AttentionLayer(
        name=spec.name,
        index=spec.index,
        region=0 if p.cross_layer else slot,
        num_kv_heads=heads,
        total_kv_heads=attn.num_kv_heads,
        head_size=attn.head_size,
        dtype=p.kv_dtype,  # type: ignore[arg-type]
        head_layout=p.head_layout,
        kv_order=kv_order,  # type: ignore[arg-type]
        pack_index=pack_index,
        k=k,
        v=v,
    )


def _mamba_layer(p: Placement, spec: LayerSpec, slot: int) -> MambaLayer:
    state, mamba = p.state, p.geom.mamba
    assert state is not None and mamba is not None
    conv_dt, ssm_dt = DTYPE_BYTES[p.conv_dtype], DTYPE_BYTES[p.ssm_dtype]
    # Page = [conv | ssm | padding]; cross-layer pages start at slot*page inside the block.
    base = slot * p.page_bytes if p.cross_layer else 0
    stride = p.block_stride
    conv_bytes = state.conv_dim * state.state_len * conv_dt
    conv: list[Part] = []
    if p.conv_layout == "DS":  # (dim, state_len): each section's channels are one run
        offset = base
        for sec in state.sections:
            unit = sec.unit_channels * state.state_len * conv_dt
            conv.append(_run(sec.name, offset, stride, sec.units, unit, sec.units_total))
            offset += sec.units * unit
    else:  # SD (state_len, dim): every row holds all channels, so a unit is one run per row
        row, channel = state.conv_dim * conv_dt, base
        for sec in state.sections:
            unit = sec.unit_channels * conv_dt
            part = _run(sec.name, channel, stride, sec.units, unit, sec.units_total)
            conv.append(msgspec.structs.replace(part, rows=state.state_len, row_stride=row))
            channel += sec.units * unit
    ssm_unit = math.prod(state.ssm_shape[1:]) * ssm_dt
    ssm = _run("ssm", base + conv_bytes, stride, state.ssm_units, ssm_unit, state.ssm_units_total)
    return MambaLayer(
        name=spec.name,
        index=spec.index,
        region=0 if p.cross_layer else slot,
        mamba_type=mamba.mamba_type,
        conv_shape=state.conv_shape(p.conv_layout),
        conv_dtype=p.conv_dtype,  # type: ignore[arg-type]
        ssm_shape=list(state.ssm_shape),
        ssm_dtype=p.ssm_dtype,  # type: ignore[arg-type]
        conv_layout=p.conv_layout,
        conv=conv,
        ssm=ssm,
    )


def place_layers(
    p: Placement, groups: Sequence[tuple[LayerKind, Sequence[tuple[LayerSpec, ...]]]]
) -> tuple[list[Region], list[Group]]:
    """Regions and wire Groups; slot i of every group lives in region i (or layer slot i)."""
    wire_groups: list[Group] = []
    for kind, slots in groups:
        layers: list[Layer] = []
        for slot, unit in enumerate(slots):
            for pack_index, spec in enumerate(unit):
                if kind == "mamba":
                    layers.append(_mamba_layer(p, spec, slot))
                else:
                    layers.append(_attention_layer(p, spec, slot, pack_index))
        wire_groups.append(
            Group(
                kind=kind,
                block_size=p.block_size,
                kernel_block_size=p.block_size if kind == "mamba" else p.kernel_block_size,
                layers=layers,
                sliding_window=p.geom.sliding_window if kind == "sliding_window" else None,
            )
        )
    return _regions(p), wire_groups
