"""The canonical form of a group's bytes: independent of kernel block size and TP layout.

Attention: for each layer, K then V, each *global* KV head's token rows (``head_size * dtype``
bytes per token) in token order, whatever the engine's kernel block size, head layout (HND or
NHD), K/V order or pool layout. Mamba/GDN: for each layer and state part (conv sections, SSM),
each global TP unit's bytes (the state is not per token). Global units follow the TP ownership
rule of :mod:`kvxferd.descriptors.tpslice`, so a unit saved by rank 1 of TP 2 is the same bytes
a TP-1 rank holds at that unit: a TP-2 save loads at TP 1 and the reverse.

A :class:`Section` is one (layer, part) over a contiguous range of global units. The group
fingerprint hashes what must match for bytes to be reusable (model, kind, layer list, dtypes,
head sizes, state part sizes, chunk size); TP size, block sizes and layouts stay out of it.
Unsliceable Mamba parts (a conv state without known sections) are per-rank shards: their unit
count and size enter the fingerprint, so they are reused only at the same TP size. A part with
rows (SD conv sections) stores each unit's rows in order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxferd.descriptors import owned_units
from kvxferd.errors import BlockIdError, StoreError
from kvxferd.wire import DTYPE_BYTES, AttentionLayer, Group, Manifest, Part

FORMAT_VERSION = 1
"""Version of the canonical format and file layout; part of every fingerprint."""


@dataclass(frozen=True)
class PartSpec:
    """One (layer, part) of a group as the store sees it on this rank."""

    layer: int
    """Model layer index."""
    name: str
    """Part name: k, v, a conv section, ssm."""
    region: int
    part: Part
    units_total: int
    """Global TP units (KV heads for attention)."""
    owned: range
    """Global units this rank holds, in local order."""
    row_bytes: int
    """Attention: bytes of one head's one token; mamba: bytes of one unit (all its rows)."""
    attention: AttentionLayer | None


def part_specs(manifest: Manifest, g: int) -> list[PartSpec]:
    """The group's parts in canonical order (layers in manifest order; k, v / conv..., ssm)."""
    group = manifest.groups[g]
    tp, rank = manifest.tp_size, manifest.tp_rank
    out = []
    for layer in group.layers:
        if isinstance(layer, AttentionLayer):
            owned = owned_units(layer.total_kv_heads, tp, rank, f"groups[{g}].total_kv_heads")
            for part in (layer.k, layer.v):
                size = layer.head_size_v if part is layer.v and layer.head_size_v else 0
                row = (size or layer.head_size) * DTYPE_BYTES[layer.dtype]
                out.append(
                    PartSpec(
                        layer.index,
                        part.name,
                        layer.region,
                        part,
                        layer.total_kv_heads,
                        owned,
                        part.unit_bytes if part.rows > 1 else row,  # packed K|V: one head's row
                        layer,
                    )  # fmt: skip
                )
        else:
            for part in [*layer.conv, layer.ssm]:
                owned = owned_units(part.units_total, tp, rank, f"groups[{g}].{part.name}")
                out.append(
                    PartSpec(
                        layer.index,
                        part.name,
                        layer.region,
                        part,
                        part.units_total,
                        owned,
                        part.rows * part.unit_bytes,
                        None,
                    )  # fmt: skip
                )
    return out


def group_fingerprint(manifest: Manifest, g: int, chunk_tokens: int) -> str:
    """16 hex digits naming what a reader's group must share with a writer's."""
    group = manifest.groups[g]
    desc: list[object] = [FORMAT_VERSION, manifest.model, group.kind, chunk_tokens]
    if group.kind == "sliding_window":
        desc.append(group.sliding_window)
    for layer in group.layers:
        if isinstance(layer, AttentionLayer):
            desc.append([layer.index, layer.name, layer.dtype, layer.head_size,
                         layer.total_kv_heads]
                        + ([layer.head_size_v] if layer.head_size_v else []))  # fmt: skip
        else:
            parts = [
                [p.name, p.units_total, p.unit_bytes]
                + ([] if p.sliceable else ["shard"])
                + ([] if p.rows == 1 else ["rows", p.rows])
                for p in [*layer.conv, layer.ssm]
            ]
            desc.append([layer.index, layer.name, layer.mamba_type, layer.conv_dtype,
                         layer.ssm_dtype, parts])  # fmt: skip
    return hashlib.blake2b(msgspec.json.encode(desc), digest_size=8).hexdigest()


# ------------------------------------------------------------------------------------------------
# Views over engine memory


def _attention_view(region: np.ndarray, spec: PartSpec, group: Group, nblocks: int) -> np.ndarray:
    """(kernel block, local head, token row, byte) view of one attention part."""
    layer, part = spec.attention, spec.part
    assert layer is not None
    kbs, row, heads = group.kernel_block_size, spec.row_bytes, layer.num_kv_heads
    nku = nblocks * (group.block_size // kbs)
    if part.rows > 1:  # vLLM 0.33 packed K|V: each head is kbs rows, row_stride apart
        strides = (part.block_stride, part.unit_stride, part.row_stride, 1)
    elif layer.head_layout == "HND":
        strides = (part.block_stride, part.unit_stride, row, 1)
    else:  # NHD: (kbs, heads, row) inside one unit
        strides = (part.block_stride, row, heads * row, 1)
    last = part.offset + (nku - 1) * part.block_stride + strides[1] * (heads - 1)
    last += strides[2] * (kbs - 1) + row
    if last > region.size:
        raise StoreError(f"layers.{layer.name}.{part.name}", "part reaches past its region")
    return np.lib.stride_tricks.as_strided(
        region[part.offset :], shape=(nku, heads, kbs, row), strides=strides
    )


def _state_view(region: np.ndarray, spec: PartSpec, nblocks: int) -> np.ndarray:
    """(block, local unit, row, byte) view of one mamba part (SD conv sections: a run per row;
    a unit's rows in order are its canonical bytes)."""
    p = spec.part
    last = p.offset + (nblocks - 1) * p.block_stride + (p.units - 1) * p.unit_stride + p.unit_bytes
    last += (p.rows - 1) * p.row_stride
    if last > region.size:
        raise StoreError(f"layers.{spec.layer}.{p.name}", "part reaches past its region")
    return np.lib.stride_tricks.as_strided(
        region[p.offset :], shape=(nblocks, p.units, p.rows, p.unit_bytes),
        strides=(p.block_stride, p.unit_stride, p.row_stride, 1),
    )  # fmt: skip


@dataclass(frozen=True)
class TokenMap:
    """Where tokens ``[start, end)`` of a request sit in an attention group's kernel blocks: one
    segment per kernel block touched, so gather and scatter copy whole row runs, once."""

    segments: list[tuple[int, int, int, int]]
    """(kernel block, first row, row count, offset in the token range)."""
    tokens: int


def token_map(group: Group, block_ids: np.ndarray, start: int, end: int, field: str) -> TokenMap:
    """The segments of tokens ``[start, end)``; BlockIdError if a token's block is missing."""
    bs, kbs = group.block_size, group.kernel_block_size
    if end > start and (end - 1) // bs >= block_ids.size:
        raise BlockIdError(field, f"{block_ids.size} blocks hold fewer than {end} tokens")
    segments, t = [], start
    while t < end:
        block = int(block_ids[t // bs])
        if block < 0:
            raise BlockIdError(field, f"a block of tokens [{start}, {end}) is -1")
        row = t % kbs
        n = min(kbs - row, end - t)
        segments.append((block * (bs // kbs) + (t % bs) // kbs, row, n, t - start))
        t += n
    return TokenMap(segments, end - start)


def gather_attention(
    region: np.ndarray, spec: PartSpec, group: Group, nblocks: int, tm: TokenMap,
    out: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """(local head, token, row) canonical bytes of one attention part over the token map, into
    ``out`` (a flat uint8 array of exactly that many bytes)."""
    view = _attention_view(region, spec, group, nblocks)
    out = out.reshape(view.shape[1], tm.tokens, spec.row_bytes)
    for ku, row, n, at in tm.segments:
        out[:, at : at + n] = view[ku, :, row : row + n]
    return out


def scatter_attention(
    region: np.ndarray, spec: PartSpec, group: Group, nblocks: int, tm: TokenMap,
    heads: slice, data: np.ndarray,
) -> None:  # fmt: skip
    """Write (head, token, row) ``data`` into local heads ``heads`` over the token map."""
    view = _attention_view(region, spec, group, nblocks)
    for ku, row, n, at in tm.segments:
        view[ku, heads, row : row + n] = data[:, at : at + n]


def gather_state(
    region: np.ndarray, spec: PartSpec, nblocks: int, block: int, out: np.ndarray
) -> np.ndarray:
    """(local unit, byte) bytes of one mamba part in ``block``, into ``out`` (flat uint8)."""
    out = out.reshape(spec.part.units, spec.part.rows, spec.part.unit_bytes)
    out[:] = _state_view(region, spec, nblocks)[block]
    return out.reshape(spec.part.units, spec.row_bytes)


def part_bytes(spec: PartSpec, group: Group, tokens: int) -> int:
    """Canonical bytes of one part of one chunk on this rank (``tokens`` rows for attention)."""
    if spec.attention is None:
        return spec.part.units * spec.row_bytes
    return spec.attention.num_kv_heads * tokens * spec.row_bytes


def scatter_state(
    region: np.ndarray, spec: PartSpec, nblocks: int, block: int, units: slice, data: np.ndarray
) -> None:
    """Write (unit, byte) ``data`` into local units ``units`` of ``block``."""
    view = _state_view(region, spec, nblocks)
    view[block, units] = data.reshape(-1, spec.part.rows, spec.part.unit_bytes)


def fill_tokens(
    manifest: Manifest, regions: list[np.ndarray], g: int, block_ids: np.ndarray,
    start: int, end: int, value: int,
) -> None:  # fmt: skip
    """Set every attention byte of tokens ``[start, end)`` of group ``g`` to ``value`` (tests and
    the simulator poison rows so that a load that skipped them cannot pass verification)."""
    group = manifest.groups[g]
    tm = token_map(group, np.asarray(block_ids, dtype=np.int64), start, end, f"block_ids[{g}]")
    for spec in part_specs(manifest, g):
        view = _attention_view(regions[spec.region], spec, group, manifest.num_blocks)
        for ku, row, n, _at in tm.segments:
            view[ku, :, row : row + n] = value
