"""A per-byte oracle: which bytes of which regions a request owns, and what each byte *is*.

Computed straight from the wire rule with no merging, slicing or descriptor logic: for every
group, requested block, kernel sub-block, layer, part, TP unit and byte, the byte at
``offset + unit * block_stride + i * unit_stride + b`` gets a label naming all of those (the TP
unit by its *global* index, the block by its position in the request). Two bytes carry the same
label exactly when a correct transfer copies one onto the other.
"""

from __future__ import annotations

import numpy as np

from kvxferd.wire import DTYPE_BYTES, AttentionLayer, Manifest

# Mixed radix of a label: group, layer, part, global unit, kernel sub-block, request slot, byte.
_RADIX = (8, 64, 8, 64, 8, 256, 1 << 16)


def _encode(*fields: np.ndarray) -> np.ndarray:
    out = np.zeros(np.broadcast_shapes(*(np.shape(f) for f in fields)), dtype=np.int64)
    for f, r in zip(fields, _RADIX, strict=True):
        assert (np.asarray(f) < r).all()
        out = out * r + f
    return out


def _first_unit(units_total: int, tp: int, rank: int) -> int:
    """Global index of the first TP unit a rank holds (split, or replicated when tp > units)."""
    if units_total % tp == 0:
        return rank * (units_total // tp)
    return rank * units_total // tp


def _parts(layer) -> list:
    if isinstance(layer, AttentionLayer):
        return [layer.k, layer.v]
    return [*layer.conv, layer.ssm]


def region_bases(manifest: Manifest) -> np.ndarray:
    """Start of each region in one flat byte array of all regions."""
    sizes = [r.size_bytes for r in manifest.regions]
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def label_bytes(manifest: Manifest, ids_per_group: list[np.ndarray]) -> np.ndarray:
    """Flat label array over all regions (see :func:`region_bases`); -1 where not requested."""
    bases = region_bases(manifest)
    labels = np.full(sum(r.size_bytes for r in manifest.regions), -1, dtype=np.int64)
    for g, (group, ids) in enumerate(zip(manifest.groups, ids_per_group, strict=True)):
        ratio = 1 if group.kind == "mamba" else group.block_size // group.kernel_block_size
        slot = np.arange(ids.size)[:, None, None, None]  # request position k
        j = np.arange(ratio)[None, :, None, None]
        unit = np.asarray(ids)[:, None, None, None] * ratio + j  # block unit
        for li, layer in enumerate(group.layers):
            for pi, p in enumerate(_parts(layer)):
                first = _first_unit(p.units_total, manifest.tp_size, manifest.tp_rank)
                i = np.arange(p.units)[None, None, :, None]
                b = np.arange(p.unit_bytes)[None, None, None, :]
                pos = bases[layer.region] + p.offset + unit * p.block_stride + i * p.unit_stride + b
                lab = _encode(g, li, pi, first + i, j, slot, b)
                pos, lab = np.broadcast_arrays(pos, lab)
                assert (labels[pos] == -1).all(), "generator bug: two parts share a byte"
                labels[pos] = lab
    return labels


def expand(bases: np.ndarray, region: np.ndarray, offset: np.ndarray, length: np.ndarray):
    """Flat byte positions of every byte of every descriptor, descriptor by descriptor."""
    if length.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = bases[region] + offset
    before = np.concatenate(([0], np.cumsum(length)[:-1]))
    return np.repeat(starts - before, length) + np.arange(int(length.sum()))


def local_positions(manifest: Manifest, plan) -> np.ndarray:
    return expand(region_bases(manifest), plan.local_region, plan.local_offset, plan.length)


def remote_positions(manifest: Manifest, plan) -> np.ndarray:
    return expand(region_bases(manifest), plan.remote_region, plan.remote_offset, plan.length)


def byte_pairs(local: Manifest, remote: Manifest, plan) -> set[tuple[int, int]]:
    """The (local byte, remote byte) pairs a plan copies, as a set."""
    return set(
        zip(
            local_positions(local, plan).tolist(),
            remote_positions(remote, plan).tolist(),
            strict=True,
        )
    )


# ------------------------------------------------------------------------------------------------
# Token labels (re-blocking): attention bytes named by token, not by block.

_TRADIX = (64, 64, 8, 64, 4096, 1 << 16)  # group, layer, part, global unit, token, byte


def _encode_t(*fields) -> np.ndarray:
    out = np.zeros(np.broadcast_shapes(*(np.shape(f) for f in fields)), dtype=np.int64)
    for f, r in zip(fields, _TRADIX, strict=True):
        assert (np.asarray(f) < r).all()
        out = out * r + f
    return out


def token_blocks(ids: np.ndarray, tokens: int, block_size: int, t: np.ndarray) -> np.ndarray:
    """Block id holding each token ``t`` (-1: none): a list shorter than the request's block
    count ends at the last token's block, otherwise it starts at block 0."""
    first = max(0, -(-tokens // block_size) - ids.size)
    pos = t // block_size - first
    ok = (pos >= 0) & (pos < ids.size)
    return np.where(ok, np.asarray(ids, dtype=np.int64)[np.clip(pos, 0, max(ids.size - 1, 0))]
                    if ids.size else -1, -1)  # fmt: skip


def label_tokens(manifest: Manifest, ids_per_group: list[np.ndarray], tokens: int,
                 upto: int | None = None) -> np.ndarray:  # fmt: skip
    """Flat labels over all regions: attention bytes of tokens ``[start, upto)`` by (model layer
    index, part, global unit, token, byte of the token row), the state block's bytes (the last
    listed id of a mamba group) by (layer index, part, unit, 0, byte); -1 elsewhere. Layers are
    named by model index, not group position: the sides may group them differently.

    ``tokens`` is the side's token count (aligns short lists), ``upto`` (default ``tokens``) the
    end of the range; ``start`` is 0, or ``upto - sliding_window`` for sliding groups. HND rows
    are one head's token (``head_size`` elements; ``row_stride`` apart when the part has per-token
    rows, vLLM's packed K|V), NHD rows the whole part's token.
    """
    upto = tokens if upto is None else upto
    bases = region_bases(manifest)
    labels = np.full(sum(r.size_bytes for r in manifest.regions), -1, dtype=np.int64)
    for group, ids in zip(manifest.groups, ids_per_group, strict=True):
        ids = np.asarray(ids, dtype=np.int64)
        if group.kind == "mamba":
            used = ids[ids >= 0]
            if used.size == 0:
                continue
            sid = int(used[-1])
            for layer in group.layers:
                for pi, p in enumerate(_parts(layer)):
                    first = _first_unit(p.units_total, manifest.tp_size, manifest.tp_rank)
                    i = np.arange(p.units)[:, None]
                    b = np.arange(p.unit_bytes)[None, :]
                    pos = (
                        bases[layer.region]
                        + p.offset
                        + sid * p.block_stride
                        + i * p.unit_stride
                        + b
                    )
                    lab = _encode_t(0, layer.index, pi, first + i, 0, b)
                    pos, lab = np.broadcast_arrays(pos, lab)
                    assert (labels[pos] == -1).all()
                    labels[pos] = lab
            continue
        start = max(0, upto - group.sliding_window) if group.sliding_window else 0
        t = np.arange(start, upto)
        blk = token_blocks(ids, tokens, group.block_size, t)
        t, blk = t[blk >= 0], blk[blk >= 0]
        kbs = group.kernel_block_size
        ratio = group.block_size // kbs
        unit = blk * ratio + (t % group.block_size) // kbs
        tau = t % kbs
        for layer in group.layers:
            row = layer.head_size * DTYPE_BYTES[layer.dtype]
            for pi, p in enumerate(_parts(layer)):
                base = bases[layer.region] + p.offset + unit * p.block_stride  # per token
                if layer.head_layout == "NHD":
                    nrow = p.units * p.unit_bytes // kbs
                    b = np.arange(nrow)[None, :]
                    pos = (base + tau * nrow)[:, None] + b
                    lab = _encode_t(0, layer.index, pi, 0, t[:, None], b)
                else:
                    first = _first_unit(p.units_total, manifest.tp_size, manifest.tp_rank)
                    i = np.arange(p.units)[None, :, None]
                    hrow = p.unit_bytes if p.rows > 1 else row
                    step = p.row_stride if p.rows > 1 else row  # packed K|V: per-token rows
                    b = np.arange(hrow)[None, None, :]
                    pos = (base + tau * step)[:, None, None] + i * p.unit_stride + b
                    lab = _encode_t(0, layer.index, pi, first + i, t[:, None, None], b)
                pos, lab = np.broadcast_arrays(pos, lab)
                assert (labels[pos] == -1).all(), "generator bug: two tokens share a byte"
                labels[pos] = lab
    return labels
