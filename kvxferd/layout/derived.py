"""Quantities derived from a manifest: pages, padding, per-layer state and KV sizes, summaries.

These are what ``kvxferd layout`` prints and what tests assert against vLLM's own numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxferd.layout.manifest import units_per_block
from kvxferd.wire import DTYPE_BYTES, AttentionLayer, Group, MambaLayer, Manifest


def block_ratio(group: Group) -> int:
    """Kernel blocks per logical block (1 for mamba groups)."""
    return units_per_block(group)


def region_slots(m: Manifest, region: int) -> int:
    """Layer slots per logical block of a region: 1 per layer tensor, L in a cross-layer one."""
    if m.layout != "cross_layer":
        return 1
    slots = 1
    for g in m.groups:
        in_region = [
            layer
            for layer in g.layers
            if layer.region == region and getattr(layer, "pack_index", 0) == 0
        ]
        slots = max(slots, len(in_region))
    return slots


def page_bytes(m: Manifest) -> int:
    """Bytes of one layer slot's page for one logical block (uniform across groups)."""
    return m.regions[0].page_bytes // region_slots(m, 0)


def kv_bytes_per_token(layer: AttentionLayer) -> int:
    """K+V bytes of one token of one attention layer on this rank."""
    return 2 * layer.num_kv_heads * layer.head_size * DTYPE_BYTES[layer.dtype]


def mamba_state_bytes(layer: MambaLayer) -> tuple[int, int]:
    """(conv, ssm) state bytes of one mamba layer on this rank, unpadded."""
    conv = math.prod(layer.conv_shape) * DTYPE_BYTES[layer.conv_dtype]
    return conv, math.prod(layer.ssm_shape) * DTYPE_BYTES[layer.ssm_dtype]


def mamba_layers(m: Manifest) -> list[MambaLayer]:
    """Every mamba layer of the manifest, in group order."""
    return [layer for g in m.groups for layer in g.layers if isinstance(layer, MambaLayer)]


def mamba_padding_bytes(m: Manifest) -> int:
    """Page bytes a mamba layer leaves unused (page minus conv+ssm); 0 without mamba layers."""
    layers = mamba_layers(m)
    if not layers:
        return 0
    return page_bytes(m) - sum(mamba_state_bytes(layers[0]))


def mamba_padding_fraction(m: Manifest) -> float:
    """Padding relative to the unpadded state, as vLLM logs it ("Padding mamba page by X%")."""
    layers = mamba_layers(m)
    if not layers:
        return 0.0
    return mamba_padding_bytes(m) / sum(mamba_state_bytes(layers[0]))


def request_blocks(m: Manifest, tokens: int) -> list[int]:
    """Logical blocks a request of ``tokens`` tokens occupies in each group: the one state
    block for mamba, only the blocks the window still needs for sliding window, else all."""
    out = []
    for g in m.groups:
        if g.kind == "mamba":
            out.append(1)
        elif g.kind == "sliding_window" and g.sliding_window:
            out.append(min(math.ceil(tokens / g.block_size), g.sliding_window // g.block_size + 2))
        else:
            out.append(math.ceil(tokens / g.block_size))
    return out


def kv_cache_tokens(m: Manifest) -> int:
    """Tokens the pool holds per sequence as vLLM logs it: blocks // groups * min block size."""
    return m.num_blocks // len(m.groups) * min(g.block_size for g in m.groups)


@dataclass(frozen=True)
class GroupSummary:
    """One KV-cache group as a table row."""

    index: int
    kind: str
    block_size: int
    kernel_block_size: int
    ratio: int
    layer_indices: tuple[int, ...]
    regions: tuple[int, ...]
    sliding_window: int | None


@dataclass(frozen=True)
class RegionSummary:
    """One pooled region as a table row, with the layers that share it."""

    index: int
    name: str
    size_bytes: int
    page_bytes: int
    num_blocks: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class LayoutSummary:
    """Everything ``kvxferd layout`` prints about a manifest."""

    model: str
    tp_rank: int
    tp_size: int
    layout: str
    attn_pack_size: int
    num_blocks: int
    page_bytes: int
    kv_bytes_per_token: int
    conv_bytes: int
    ssm_bytes: int
    mamba_padding_bytes: int
    mamba_padding_fraction: float
    total_bytes: int
    kv_cache_tokens: int
    groups: tuple[GroupSummary, ...]
    regions: tuple[RegionSummary, ...]


def summarize(m: Manifest) -> LayoutSummary:
    """A :class:`LayoutSummary` of ``m`` (per layer sizes taken from the first layer of a kind)."""
    attn = [layer for g in m.groups for layer in g.layers if isinstance(layer, AttentionLayer)]
    mamba = mamba_layers(m)
    conv, ssm = mamba_state_bytes(mamba[0]) if mamba else (0, 0)
    sharers: dict[int, list[str]] = {r: [] for r in range(len(m.regions))}
    for g in m.groups:
        for layer in g.layers:
            sharers[layer.region].append(layer.name)
    return LayoutSummary(
        model=m.model,
        tp_rank=m.tp_rank,
        tp_size=m.tp_size,
        layout=m.layout,
        attn_pack_size=m.attn_pack_size,
        num_blocks=m.num_blocks,
        page_bytes=page_bytes(m),
        kv_bytes_per_token=kv_bytes_per_token(attn[0]) if attn else 0,
        conv_bytes=conv,
        ssm_bytes=ssm,
        mamba_padding_bytes=mamba_padding_bytes(m),
        mamba_padding_fraction=mamba_padding_fraction(m),
        total_bytes=sum(r.size_bytes for r in m.regions),
        kv_cache_tokens=kv_cache_tokens(m),
        groups=tuple(
            GroupSummary(
                index=i,
                kind=g.kind,
                block_size=g.block_size,
                kernel_block_size=g.kernel_block_size,
                ratio=block_ratio(g),
                layer_indices=tuple(layer.index for layer in g.layers),
                regions=tuple(sorted({layer.region for layer in g.layers})),
                sliding_window=g.sliding_window,
            )
            for i, g in enumerate(m.groups)
        ),
        regions=tuple(
            RegionSummary(
                index=r,
                name=region.name,
                size_bytes=region.size_bytes,
                page_bytes=region.page_bytes,
                num_blocks=region.num_blocks,
                layer_names=tuple(sharers[r]),
            )
            for r, region in enumerate(m.regions)
        ),
    )
