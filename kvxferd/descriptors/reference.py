"""vLLM's NixlConnector descriptor scheme: the baseline our counts and throughput are compared to.

vLLM 0.33 packs K and V per token and reads each attention layer's page with one descriptor per
block; older vLLM (block-packed pages, no rows) used separate K and V descriptors per kernel
block. Each mamba layer takes one descriptor per conv section plus one for the SSM state when the
conv state is DS-split (x, B, C, ssm), else two (conv, ssm), per logical block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxferd.descriptors.geometry import kernel_ids, kernel_ratio, part_field
from kvxferd.descriptors.mapping import read_geometry
from kvxferd.descriptors.plan import ReadPlan
from kvxferd.errors import BlockIdError, IncompatiblePeerError, ManifestError
from kvxferd.wire import AttentionLayer, Layer, Manifest, Part


def reference_descriptor_count(manifest: Manifest, block_ids_per_group: Sequence) -> int:
    """Descriptors per side vLLM's per-layer, per-kernel-block, K/V-split scheme would use."""
    if len(block_ids_per_group) != len(manifest.groups):
        raise BlockIdError(
            "block_ids",
            f"{len(block_ids_per_group)} id lists for {len(manifest.groups)} groups",
        )
    total = 0
    for g, (group, ids) in enumerate(zip(manifest.groups, block_ids_per_group, strict=True)):
        per_block = 0
        ratio = kernel_ratio(group, f"groups[{g}]")
        for layer in group.layers:
            if isinstance(layer, AttentionLayer) and _packed(layer):
                k = layer.k
                per_block += 1 if ratio == 1 or _page_len(layer) == k.block_stride else ratio
            elif isinstance(layer, AttentionLayer):
                per_block += 2 * ratio
            elif layer.conv_layout == "DS":
                per_block += len(layer.conv) + 1
            else:
                per_block += 2
        total += per_block * len(ids)
    return total


def _extent(part: Part, field: str) -> int:
    """Bytes of one block unit of a part, which vLLM addresses as one contiguous range."""
    if part.rows > 1 or (part.units > 1 and part.unit_stride != part.unit_bytes):
        raise ManifestError(field, "the reference scheme needs contiguous TP units")
    return part.units * part.unit_bytes


def _packed(layer: AttentionLayer) -> bool:
    return layer.k.rows > 1 or layer.v.rows > 1


def _page_len(layer: AttentionLayer) -> int:
    """Bytes of one block unit's [K|V] page if its K and V rows tile one run, else 0."""
    parts = (layer.k, layer.v)
    start = min(p.offset for p in parts)
    end = max(
        p.offset + (p.units - 1) * p.unit_stride + (p.rows - 1) * p.row_stride + p.unit_bytes
        for p in parts
    )
    moved = sum(p.units * p.rows * p.unit_bytes for p in parts)
    return end - start if moved == end - start else 0  # parts never overlap (validated)


def _ranges(layer: Layer, g: int, i: int, ratio: int) -> list[tuple[int, int, int, int]]:
    """``(offset, length, stride, kernel blocks per step)`` of each descriptor vLLM uses: per
    kernel block (1) or, for a packed page whose kernel blocks are adjacent, per block (ratio)."""
    if isinstance(layer, AttentionLayer) and _packed(layer):
        k = layer.k
        length = _page_len(layer)
        if not length:
            raise ManifestError(part_field(g, i, "k"), "the reference scheme needs whole pages")
        start = min(k.offset, layer.v.offset)
        if ratio > 1 and length == k.block_stride:  # a block's kernel pages are one run
            return [(start, ratio * length, ratio * k.block_stride, ratio)]
        return [(start, length, k.block_stride, 1)]
    if isinstance(layer, AttentionLayer):
        return [
            (p.offset, _extent(p, part_field(g, i, n)), p.block_stride, 1)
            for n, p in (("k", layer.k), ("v", layer.v))
        ]
    ssm = (layer.ssm.offset, _extent(layer.ssm, part_field(g, i, "ssm")), layer.ssm.block_stride)
    if layer.conv_layout == "DS":
        conv = [
            (p.offset, _extent(p, part_field(g, i, f"conv[{j}]")), p.block_stride, 1)
            for j, p in enumerate(layer.conv)
        ]
        return [*conv, (*ssm, 1)]
    # The whole conv state is one tensor: one descriptor from its first to its last byte (SD
    # sections are one run per row, so the last byte is in the last row of the last unit).
    start = min(p.offset for p in layer.conv)
    end = max(
        p.offset + (p.rows - 1) * p.row_stride + (p.units - 1) * p.unit_stride + p.unit_bytes
        for p in layer.conv
    )
    return [(start, end - start, layer.conv[0].block_stride, 1), (*ssm, 1)]


def reference_plan(
    local: Manifest,
    remote: Manifest,
    local_ids: Sequence[np.ndarray],
    remote_ids: Sequence[np.ndarray],
) -> ReadPlan:
    """The descriptor pairs of vLLM's scheme for one request (equal TP size and rank only).

    Moves exactly the bytes :func:`~kvxferd.descriptors.plan_read` moves, in
    :func:`reference_descriptor_count` descriptors, never merged. Used by benchmarks to drive
    the baseline scheme through NIXL; raises like ``plan_read``, and ManifestError for unequal TP.
    """
    if (local.tp_size, local.tp_rank) != (remote.tp_size, remote.tp_rank):
        raise ManifestError(
            "tp_size",
            f"reference scheme is built for equal ranks, got local {local.tp_rank}/"
            f"{local.tp_size} and remote {remote.tp_rank}/{remote.tp_size}",
        )
    geo = read_geometry(local, remote)  # compatibility checks, as for a real pull
    if geo.reblock is not None:  # vLLM's scheme pairs block ids: equal block sizes only
        raise IncompatiblePeerError(geo.reblock.block_diff)
    cols: list[list[np.ndarray]] = [[] for _ in range(5)]
    kv_bytes = state_bytes = 0
    for g, (a, b) in enumerate(geo.check_pairs(local_ids, remote_ids)):
        rows: dict[int, list[tuple[int, ...]]] = {}  # kernel blocks per step -> descriptors
        ratio = geo.ratios[g]
        layers = zip(local.groups[g].layers, remote.groups[g].layers, strict=True)
        for i, (ll, rl) in enumerate(layers):
            for lr, rr in zip(_ranges(ll, g, i, ratio), _ranges(rl, g, i, ratio), strict=True):
                if lr[3] != rr[3]:  # one side's block page is one run, the other's is not
                    raise IncompatiblePeerError({f"groups[{g}].layers[{i}]": (lr[3], rr[3])})
                rows.setdefault(lr[3], []).append(
                    (ll.region, lr[0], lr[2], rl.region, rr[0], rr[2], lr[1])
                )
        if a.size == 0:
            continue
        for step, group_rows in rows.items():
            t = np.asarray(group_rows, dtype=np.int64).T
            kl, kr = kernel_ids(a, ratio // step), kernel_ids(b, ratio // step)
            cols[0].append(np.repeat(t[0], kl.size))
            cols[1].append((t[1][:, None] + t[2][:, None] * kl[None, :]).ravel())
            cols[2].append(np.repeat(t[3], kl.size))
            cols[3].append((t[4][:, None] + t[5][:, None] * kr[None, :]).ravel())
            cols[4].append(np.repeat(t[6], kl.size))
            moved = int(t[6].sum()) * kl.size
            if geo.is_attention[g]:
                kv_bytes += moved
            else:
                state_bytes += moved
    if not cols[0]:
        return ReadPlan.empty()
    lreg, loff, rreg, roff, ln = (np.concatenate(c) for c in cols)
    return ReadPlan(lreg, loff, rreg, roff, ln, kv_bytes, state_bytes)
