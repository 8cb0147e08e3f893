"""Block-unit geometry of a manifest: which parts a group has, and where they may reach.

Every descriptor in this package is derived from the wire rule (see :mod:`kvxferd.wire`): part
``p`` of block unit ``u`` starts ``p.offset + u * p.block_stride`` bytes into its region, and TP
unit ``i`` inside it ``i * p.unit_stride`` further on, ``p.unit_bytes`` long.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np

from kvxferd.errors import BlockIdError, ManifestError
from kvxferd.wire import AttentionLayer, Group, Layer, MambaLayer, Manifest, Part

Family = Literal["attention", "mamba"]
_MAX_INT64 = (1 << 63) - 1


def family(group: Group) -> Family:
    """``attention`` for full-attention and sliding-window groups, ``mamba`` otherwise."""
    return "mamba" if group.kind == "mamba" else "attention"


def kernel_ratio(group: Group, field: str = "groups") -> int:
    """Kernel blocks per logical block: ``block_size // kernel_block_size``, 1 for mamba."""
    if group.kind == "mamba":
        return 1
    kbs, bs = group.kernel_block_size, group.block_size
    if kbs <= 0 or bs <= 0 or bs % kbs:
        raise ManifestError(
            f"{field}.kernel_block_size",
            f"block_size {bs} is not a positive multiple of kernel_block_size {kbs}",
        )
    return bs // kbs


def layer_parts(layer: Layer) -> list[tuple[str, Part]]:
    """The parts of a layer with their field names: ``k``, ``v`` or ``conv[j]``..., ``ssm``."""
    if isinstance(layer, AttentionLayer):
        return [("k", layer.k), ("v", layer.v)]
    return [(f"conv[{j}]", p) for j, p in enumerate(layer.conv)] + [("ssm", layer.ssm)]


def iter_parts(manifest: Manifest) -> Iterator[tuple[int, int, str, Layer, Part]]:
    """Every ``(group index, layer index, part name, layer, part)`` of a manifest."""
    for g, group in enumerate(manifest.groups):
        for i, layer in enumerate(group.layers):
            for name, part in layer_parts(layer):
                yield g, i, name, layer, part


def part_field(g: int, i: int, name: str) -> str:
    """The manifest path of a part, e.g. ``groups[0].layers[3].k``."""
    return f"groups[{g}].layers[{i}].{name}"


def check_geometry(manifest: Manifest) -> None:
    """Reject a manifest whose parts point outside their regions or into the wrong group kind.

    Raises :class:`ManifestError` naming the field (fail closed: a descriptor built from such a
    manifest would read or write someone else's memory).
    """
    if manifest.num_blocks <= 0:
        raise ManifestError("num_blocks", f"must be positive, got {manifest.num_blocks}")
    for g, group in enumerate(manifest.groups):
        ratio = kernel_ratio(group, f"groups[{g}]")
        units = manifest.num_blocks * ratio
        want = MambaLayer if group.kind == "mamba" else AttentionLayer
        for i, layer in enumerate(group.layers):
            lf = f"groups[{g}].layers[{i}]"
            if not isinstance(layer, want):
                raise ManifestError(lf, f"a {type(layer).__name__} in a {group.kind} group")
            if not 0 <= layer.region < len(manifest.regions):
                raise ManifestError(f"{lf}.region", f"no region {layer.region}")
            size = manifest.regions[layer.region].size_bytes
            for name, p in layer_parts(layer):
                pf = f"{lf}.{name}"
                if p.units <= 0 or p.unit_bytes <= 0 or p.units_total <= 0:
                    raise ManifestError(pf, "units, unit_bytes and units_total must be positive")
                if p.units > 1 and p.unit_stride < p.unit_bytes:
                    raise ManifestError(f"{pf}.unit_stride", "TP units overlap")
                if p.offset < 0 or p.block_stride < 0:
                    raise ManifestError(pf, "offset and block_stride must not be negative")
                if max(p.offset, p.block_stride, p.unit_stride, p.row_stride) > _MAX_INT64:
                    # one a bound below never sees (it multiplies 0): descriptors are int64
                    raise ManifestError(pf, "offset and strides must be below 2**63")
                if p.rows < 1 or (p.rows > 1 and p.row_stride < p.unit_bytes):
                    raise ManifestError(f"{pf}.rows", "rows must be positive and not overlap")
                end = p.offset + (units - 1) * p.block_stride + (p.units - 1) * p.unit_stride
                end += (p.rows - 1) * p.row_stride
                if end + p.unit_bytes > size:
                    raise ManifestError(
                        pf, f"block unit {units - 1} ends at {end + p.unit_bytes} > region {size}"
                    )


def check_block_ids(num_blocks: int, ids: object, field: str) -> np.ndarray:
    """One group's logical block ids as int64, or :class:`BlockIdError` naming the bad entry.

    Ids must be integers in ``[0, num_blocks)`` with no repeats (a repeat would read the same
    block twice into two places, or two blocks into one).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise BlockIdError(field, f"expected a flat list of ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "u" or (arr.dtype.kind == "f" and isinstance(ids, list)):
        # ints past int64 (msgpack carries them): uint64 would wrap, a mix reads as floats
        k = next((k for k, b in enumerate(ids) if not 0 <= b < num_blocks), -1)  # type: ignore[arg-type]
        if k >= 0:
            raise BlockIdError(f"{field}[{k}]", f"id {ids[k]} outside [0, {num_blocks})")  # type: ignore[index]
    if arr.dtype.kind not in "iu":
        raise BlockIdError(field, f"ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero((arr < 0) | (arr >= num_blocks))
    if bad.size:
        k = int(bad[0])
        raise BlockIdError(f"{field}[{k}]", f"id {int(arr[k])} outside [0, {num_blocks})")
    order = np.argsort(arr, kind="stable")
    srt = arr[order]
    rep = np.flatnonzero(srt[1:] == srt[:-1])
    if rep.size:
        k = int(order[rep + 1].min())
        first = int(np.flatnonzero(arr == arr[k])[0])
        raise BlockIdError(f"{field}[{k}]", f"id {int(arr[k])} repeats {field}[{first}]")
    return arr


def check_request_ids(
    num_blocks: int, num_groups: int, ids_per_group: object, field: str
) -> list[np.ndarray]:
    """Validate one id list per group (same order as the manifest's groups)."""
    try:
        seq = list(ids_per_group)  # type: ignore[call-overload]
    except TypeError:
        raise BlockIdError(field, "expected one list of block ids per group") from None
    if len(seq) != num_groups:
        raise BlockIdError(field, f"{len(seq)} id lists for {num_groups} groups (one per group)")
    fast = _valid_ids(num_blocks, seq)
    if fast is not None:
        return fast
    return [check_block_ids(num_blocks, ids, f"{field}[{g}]") for g, ids in enumerate(seq)]


SMALL_IDS = 512
"""Up to this many ids in all, a request's ids are checked as Python ints: numpy's fixed cost
per call was most of planning a short pull (issue 11). Measured here: Python is faster up to
about 700 ids (2: 7 us against 61; 512: 56 against 69)."""


def _valid_ids(num_blocks: int, seq: list) -> list[np.ndarray] | None:
    """All groups' ids checked at once (a pull's planning runs per request), or None when any
    check fails or an input is unusual: the per-group checks then name the bad entry."""
    parts = [np.asarray(ids) for ids in seq]
    if not parts or any(a.ndim != 1 or (a.size and a.dtype.kind not in "iu") for a in parts):
        return None
    sizes = [a.size for a in parts]
    if sum(sizes) <= SMALL_IDS:
        for a in parts:
            ids = a.tolist()
            if ids and (min(ids) < 0 or max(ids) >= num_blocks or len(set(ids)) != len(ids)):
                return None
        return [a.astype(np.int64, copy=False) for a in parts]
    flat = np.concatenate([a.astype(np.int64, copy=False) for a in parts])
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= num_blocks):
        return None
    key = np.repeat(np.arange(len(parts), dtype=np.int64), sizes) * num_blocks + flat
    key.sort()
    if key.size > 1 and bool((key[1:] == key[:-1]).any()):
        return None  # a repeat within a group
    return np.split(flat, np.cumsum(sizes[:-1]))


def kernel_ids(logical_ids: np.ndarray, ratio: int) -> np.ndarray:
    """Expand logical ids to kernel block ids ``L * ratio + j`` (j < ratio), id-major."""
    if ratio == 1:
        return logical_ids
    return (logical_ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).ravel()


LayerPair = tuple[int, int, int, int]
"""``(local group, local layer, remote group, remote layer)`` of one model layer on both sides."""


def layer_pairs(local: Manifest, remote: Manifest) -> tuple[list[LayerPair], bool] | None:
    """The same model layer on both sides, and whether the sides group the layers differently.

    Same groups (count and layer indices, in order): the layers pair by position. Regrouped
    (vLLM groups hybrid layers by page size, e.g. per attention pack size): by layer index,
    when both sides have the same layer indices. Otherwise None (the structures differ).
    """
    lidx = [[layer.index for layer in g.layers] for g in local.groups]
    ridx = [[layer.index for layer in g.layers] for g in remote.groups]
    if lidx == ridx:
        return [(g, i, g, i) for g, ids in enumerate(lidx) for i in range(len(ids))], False
    where = {x: (g, i) for g, ids in enumerate(ridx) for i, x in enumerate(ids)}
    flat = [x for ids in lidx for x in ids]
    if sorted(flat) != sorted(where) or len(set(flat)) != len(flat):
        return None
    return [(g, i, *where[x]) for g, ids in enumerate(lidx) for i, x in enumerate(ids)], True
