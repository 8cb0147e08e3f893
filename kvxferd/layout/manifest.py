"""Manifest validation: every check the data plane relies on, each naming the offending field.

A manifest may come from our planner or from a real engine; either way nothing is registered or
read until :func:`validate_manifest` has passed. Overlap and bounds are checked exactly over all
block units (see :mod:`kvxferd.layout.overlap`), in time independent of the number of blocks.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from kvxferd.errors import ManifestError
from kvxferd.layout.overlap import Series, first_overlap
from kvxferd.wire import (
    DTYPE_BYTES,
    MANIFEST_VERSION,
    AttentionLayer,
    Group,
    MambaLayer,
    Manifest,
    Part,
)

_KIND_LAYER = {"full_attention": AttentionLayer, "sliding_window": AttentionLayer}


def _fail(field: str, reason: str) -> ManifestError:
    return ManifestError(field, reason)


def units_per_block(group: Group) -> int:
    """Block units per logical block: kernel blocks for attention, 1 for mamba."""
    return 1 if group.kind == "mamba" else group.block_size // group.kernel_block_size


def part_series(part: Part, count: int, label: str) -> list[Series]:
    """A part over ``count`` block units as interval series (one per unit unless contiguous)."""
    if part.units == 1 or part.unit_stride == part.unit_bytes:
        length = part.units * part.unit_bytes
        return [Series(part.offset, part.block_stride, length, count, label)]
    return [
        Series(part.offset + i * part.unit_stride, part.block_stride, part.unit_bytes, count, label)
        for i in range(part.units)
    ]


def packed_series(layer: AttentionLayer | MambaLayer, count: int, label: str) -> list[Series]:
    """A layer whose parts have rows (vLLM's packed K|V) as interval series of its merged runs.

    K and V rows interleave, so each alone is many runs; together they usually tile each head (or
    the whole block unit). Runs of one block unit are merged where adjacent; two parts sharing a
    byte raise ManifestError naming the layer.
    """
    parts = layer_parts(layer)
    stride = parts[0].block_stride
    if any(p.block_stride != stride for p in parts):
        raise _fail(f"{label}.k.block_stride", "parts of a packed layer differ in block stride")
    starts, lengths = [], []
    for p in parts:
        grid = (
            p.offset
            + np.arange(p.units, dtype=np.int64)[:, None] * p.unit_stride
            + np.arange(p.rows, dtype=np.int64)[None, :] * p.row_stride
        ).ravel()
        starts.append(grid)
        lengths.append(np.full(grid.size, p.unit_bytes, dtype=np.int64))
    start, length = np.concatenate(starts), np.concatenate(lengths)
    order = np.argsort(start, kind="stable")
    start, length = start[order], length[order]
    end = start + length
    if np.any(start[1:] < end[:-1]):
        raise _fail(label, "its K and V runs overlap inside a block unit")
    new = np.flatnonzero(np.r_[True, start[1:] != end[:-1]])
    last = np.r_[new[1:], start.size] - 1
    return [
        Series(int(start[a]), stride, int(end[b] - start[a]), count, label)
        for a, b in zip(new, last, strict=True)
    ]


def _series(layer: AttentionLayer | MambaLayer, count: int, lf: str) -> list[Series]:
    """All interval series of one layer (merged runs for a packed layer)."""
    if any(p.rows > 1 for p in layer_parts(layer)):
        return packed_series(layer, count, lf)
    return [
        s
        for part, pname in zip(layer_parts(layer), _part_names(layer), strict=True)
        for s in part_series(part, count, f"{lf}.{pname}")
    ]


def layer_parts(layer: AttentionLayer | MambaLayer) -> list[Part]:
    """The layer's parts in address order of a block unit (k, v or conv..., ssm)."""
    if isinstance(layer, AttentionLayer):
        return [layer.k, layer.v]
    return [*layer.conv, layer.ssm]


def _check_identity(m: Manifest) -> None:
    if m.version != MANIFEST_VERSION:
        raise _fail("version", f"{m.version} is not the supported {MANIFEST_VERSION}")
    if m.tp_size < 1:
        raise _fail("tp_size", f"{m.tp_size} < 1")
    if not 0 <= m.tp_rank < m.tp_size:
        raise _fail("tp_rank", f"{m.tp_rank} not in [0, {m.tp_size})")
    if m.num_blocks < 1:
        raise _fail("num_blocks", f"{m.num_blocks} < 1")
    if m.attn_pack_size < 1:
        raise _fail("attn_pack_size", f"{m.attn_pack_size} < 1")
    if not m.regions:
        raise _fail("regions", "no region")
    if not m.groups:
        raise _fail("groups", "no group")


def _check_regions(m: Manifest) -> None:
    names: set[str] = set()
    first = m.regions[0]
    for r, region in enumerate(m.regions):
        f = f"regions[{r}]"
        if not region.name or region.name in names:
            raise _fail(f"{f}.name", f"empty or duplicate name {region.name!r}")
        names.add(region.name)
        if region.device_id < 0 or (region.mem == "DRAM" and region.device_id != 0):
            raise _fail(f"{f}.device_id", f"{region.device_id}: a GPU index, 0 for DRAM")
        # One READ's descriptors on each side share one NIXL memory type and device.
        for attr in ("mem", "device_id"):
            if getattr(region, attr) != getattr(first, attr):
                raise _fail(f"{f}.{attr}", f"{getattr(region, attr)!r} differs from regions[0]'s "
                                           f"{getattr(first, attr)!r}: one rank's regions share "
                                           "one memory")  # fmt: skip
        if region.num_blocks != m.num_blocks:
            raise _fail(f"{f}.num_blocks", f"{region.num_blocks} != manifest {m.num_blocks}")
        if region.page_bytes < 1:
            raise _fail(f"{f}.page_bytes", f"{region.page_bytes} < 1")
        if region.size_bytes < region.num_blocks * region.page_bytes:
            raise _fail(
                f"{f}.size_bytes",
                f"{region.size_bytes} < num_blocks*page_bytes = "
                f"{region.num_blocks * region.page_bytes}",
            )


def _check_part(part: Part, f: str) -> None:
    if part.offset < 0:
        raise _fail(f"{f}.offset", f"{part.offset} < 0")
    if min(part.units, part.unit_bytes, part.units_total) < 1:
        raise _fail(f"{f}.units", "units, unit_bytes and units_total must be positive")
    if part.rows < 1 or (part.rows > 1 and part.row_stride < part.unit_bytes):
        raise _fail(f"{f}.rows", f"{part.rows} rows {part.row_stride} B apart overlap or none")
    if part.units > 1 and part.unit_stride < part.unit_bytes:
        raise _fail(f"{f}.unit_stride", f"{part.unit_stride} < unit_bytes {part.unit_bytes}")
    if part.block_stride < 1:
        raise _fail(f"{f}.block_stride", f"{part.block_stride} < 1")


def _check_attention(m: Manifest, g: Group, layer: AttentionLayer, f: str) -> None:
    want_heads = max(1, layer.total_kv_heads // m.tp_size)
    if layer.num_kv_heads != want_heads:
        raise _fail(f"{f}.num_kv_heads", f"{layer.num_kv_heads}, expected {want_heads}")
    if not 0 <= layer.pack_index < m.attn_pack_size:
        raise _fail(f"{f}.pack_index", f"{layer.pack_index} not in [0, {m.attn_pack_size})")
    for name, part in (("k", layer.k), ("v", layer.v)):
        size = layer.head_size_v if name == "v" and layer.head_size_v else layer.head_size
        head = g.kernel_block_size * size * DTYPE_BYTES[layer.dtype]
        pf = f"{f}.{name}"
        if part.units * part.unit_bytes * part.rows != head * layer.num_kv_heads:
            raise _fail(
                f"{pf}.unit_bytes",
                f"units*unit_bytes={part.units * part.unit_bytes} != kernel_block_size*heads*"
                f"head_size*dtype = {head * layer.num_kv_heads}",
            )
        if layer.head_layout == "HND" and part.units != layer.num_kv_heads:
            raise _fail(f"{pf}.units", f"HND holds one unit per head ({layer.num_kv_heads})")
        if part.rows == 1 and layer.head_layout == "NHD" and (part.units != 1 or part.sliceable):
            raise _fail(f"{pf}.sliceable", "NHD heads interleave: one unsliceable unit")


def _check_mamba(layer: MambaLayer, f: str) -> None:
    conv_bytes = math.prod(layer.conv_shape) * DTYPE_BYTES[layer.conv_dtype]
    parts_bytes = sum(p.units * p.unit_bytes * p.rows for p in layer.conv)
    if len(layer.conv_shape) != 2 or parts_bytes != conv_bytes:
        raise _fail(f"{f}.conv", f"parts hold {parts_bytes} B, conv_shape needs {conv_bytes} B")
    if not all(p.sliceable for p in layer.conv):
        if len(layer.conv) != 1 or layer.conv[0].rows != 1:
            raise _fail(f"{f}.conv", "an unsliceable conv state is one part of one run")
    elif layer.conv_layout == "SD":  # sections: one run per conv row, a whole row apart
        length, row = layer.conv_shape[0], layer.conv_shape[1] * DTYPE_BYTES[layer.conv_dtype]
        for j, p in enumerate(layer.conv):
            if p.rows != length or (p.rows > 1 and p.row_stride != row):
                raise _fail(
                    f"{f}.conv[{j}].rows",
                    f"{p.rows} rows {p.row_stride} B apart, SD needs {length} {row} B apart",
                )
    elif any(p.rows != 1 for p in layer.conv):
        raise _fail(f"{f}.conv", "DS sections are one run per unit (rows = 1)")
    ssm_bytes = math.prod(layer.ssm_shape) * DTYPE_BYTES[layer.ssm_dtype]
    if layer.ssm.units * layer.ssm.unit_bytes != ssm_bytes:
        raise _fail(
            f"{f}.ssm.unit_bytes",
            f"units*unit_bytes={layer.ssm.units * layer.ssm.unit_bytes} != ssm_shape {ssm_bytes}",
        )


def _check_groups(m: Manifest) -> None:
    names: set[str] = set()
    for gi, g in enumerate(m.groups):
        f = f"groups[{gi}]"
        if g.block_size < 1 or g.kernel_block_size < 1:
            raise _fail(f"{f}.block_size", "block sizes must be positive")
        if g.block_size % g.kernel_block_size:
            raise _fail(
                f"{f}.kernel_block_size",
                f"{g.kernel_block_size} does not divide block_size {g.block_size}",
            )
        if g.kind == "mamba" and g.kernel_block_size != g.block_size:
            raise _fail(f"{f}.kernel_block_size", "mamba blocks are never split")
        if (g.sliding_window is not None) != (g.kind == "sliding_window"):
            raise _fail(f"{f}.sliding_window", f"{g.sliding_window!r} for a {g.kind} group")
        if g.sliding_window is not None and g.sliding_window < 1:  # the store needs a window
            raise _fail(f"{f}.sliding_window", f"{g.sliding_window} < 1 token")
        if not g.layers:
            raise _fail(f"{f}.layers", "empty group")
        for li, layer in enumerate(g.layers):
            lf = f"{f}.layers[{li}]"
            if not isinstance(layer, _KIND_LAYER.get(g.kind, MambaLayer)):
                raise _fail(lf, f"{type(layer).__name__} in a {g.kind} group")
            if layer.name in names:
                raise _fail(f"{lf}.name", f"duplicate layer name {layer.name!r}")
            names.add(layer.name)
            if not 0 <= layer.region < len(m.regions):
                raise _fail(f"{lf}.region", f"{layer.region} not in [0, {len(m.regions)})")
            for part, pname in zip(layer_parts(layer), _part_names(layer), strict=True):
                _check_part(part, f"{lf}.{pname}")
            if isinstance(layer, AttentionLayer):
                _check_attention(m, g, layer, lf)
            else:
                _check_mamba(layer, lf)


def _part_names(layer: AttentionLayer | MambaLayer) -> list[str]:
    if isinstance(layer, AttentionLayer):
        return ["k", "v"]
    return [*(f"conv[{i}]" for i in range(len(layer.conv))), "ssm"]


def _page_local(part: Part, per_block: int, page: int) -> bool:
    """Whether logical block b's units of ``part`` all lie in ``[b*page, (b+1)*page)``."""
    extent = (part.units - 1) * part.unit_stride + (part.rows - 1) * part.row_stride
    extent += part.unit_bytes
    return (
        part.block_stride * per_block == page
        and part.offset + (per_block - 1) * part.block_stride + extent <= page
    )


def _geometry(layer: AttentionLayer | MambaLayer) -> tuple:
    return tuple(
        (p.offset, p.block_stride, p.units, p.unit_bytes, p.unit_stride, p.rows, p.row_stride)
        for p in layer_parts(layer)
    )


def _check_placement(m: Manifest) -> None:
    """Bounds, overlap within a group, and safe sharing of a region by several groups."""
    by_region: dict[int, dict[int, list[tuple[str, AttentionLayer | MambaLayer]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for gi, g in enumerate(m.groups):
        count = units_per_block(g) * m.num_blocks
        for li, layer in enumerate(g.layers):
            lf = f"groups[{gi}].layers[{li}]"
            region = m.regions[layer.region]
            for s in _series(layer, count, lf):
                if s.end > region.size_bytes:
                    raise _fail(
                        s.label,
                        f"last block unit ends at {s.end}, past regions[{layer.region}] "
                        f"size {region.size_bytes}",
                    )
            by_region[layer.region][gi].append((lf, layer))
    for r, groups in by_region.items():
        for gi, members in groups.items():
            count = units_per_block(m.groups[gi]) * m.num_blocks
            series = [s for lf, layer in members for s in _series(layer, count, lf)]
            hit = first_overlap(series)
            if hit is not None:
                raise _fail(hit[1].label, f"overlaps {hit[0].label} in regions[{r}]")
        if len(groups) > 1:
            _check_sharing(m, r, groups)


def _check_sharing(
    m: Manifest, r: int, groups: dict[int, list[tuple[str, AttentionLayer | MambaLayer]]]
) -> None:
    """Groups share a region by block id. Safe when every block's bytes stay in that block's
    page, or when all sharers use one identical geometry (K/V-first pure attention)."""
    page = m.regions[r].page_bytes
    members = [
        (lf, units_per_block(m.groups[gi]), layer) for gi, ms in groups.items() for lf, layer in ms
    ]
    if all(
        _page_local(p, per_block, page)
        for _lf, per_block, layer in members
        for p in layer_parts(layer)
    ):
        return
    first = (members[0][1], _geometry(members[0][2]))
    for lf, per_block, layer in members[1:]:
        if (per_block, _geometry(layer)) != first:
            raise _fail(
                lf,
                f"shares regions[{r}] with another group, but neither are its blocks page-local "
                f"nor is it laid out like {members[0][0]}",
            )


def validate_manifest(m: Manifest) -> None:
    """Raise :class:`ManifestError` (naming the field) unless ``m`` is self-consistent."""
    _check_identity(m)
    _check_regions(m)
    _check_groups(m)
    _check_placement(m)
