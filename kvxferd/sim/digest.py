"""A 64-bit digest of a request's KV bytes that does not depend on block ids or TP layout.

Every (layer, part, global TP unit, block ordinal, kernel sub-block) row of the request is hashed
where it lies in the pool: a linear hash of its 64-bit words with odd weights (so any single
changed byte changes it), xor-ed with the row's identity and mixed. The digest is the sum of the
mixed rows mod 2**64, so ranks add their shares in any order and a replicated TP unit counts on
its first holder only. Two engines with different block ids or TP sizes that hold the same
bytes for a request get the same digest; one wrong byte almost surely changes it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvxferd.descriptors import owned_units, unit_holders
from kvxferd.errors import ManifestError
from kvxferd.wire import AttentionLayer, Manifest, Part

_MASK = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ORD = np.uint64(0x9E3779B97F4A7C15)
_SUB = np.uint64(0xC2B2AE3D27D4EB4F)
_UNIT = np.uint64(0x165667B19E3779F9)
_RANK = np.uint64(0xD6E8FEB86659FD93)
_CHUNK_BYTES = 32 << 20


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=256)
def _weights(n: int) -> np.ndarray:
    """``n`` fixed odd 64-bit weights."""
    w = _mix(np.arange(1, n + 1, dtype=np.uint64) * _ORD) | np.uint64(1)
    w.flags.writeable = False
    return w


def _part_key(layer_index: int, part: str) -> np.uint64:
    digest = hashlib.blake2b(f"{layer_index}|{part}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def rank_digest(
    manifest: Manifest, regions: Sequence[np.ndarray], block_ids: Sequence[Sequence[int]]
) -> int:
    """This rank's share of the request digest (add the shares of all ranks mod 2**64)."""
    total = 0
    for g, group in enumerate(manifest.groups):
        ids = np.asarray(block_ids[g], dtype=np.int64)
        if ids.size == 0:
            continue
        for layer in group.layers:
            ratio = 1
            if isinstance(layer, AttentionLayer):
                ratio = group.block_size // group.kernel_block_size
                parts = [layer.k, layer.v]
            else:
                parts = [*layer.conv, layer.ssm]
            for part in parts:
                total += _part_digest(
                    manifest, regions[layer.region], layer.index, part, ids, ratio
                )
    return total & _MASK


def request_digest(
    manifests: Sequence[Manifest],
    regions: Sequence[Sequence[np.ndarray]],
    block_ids: Sequence[Sequence[int]],
) -> int:
    """The digest of a request held by every rank of an engine (same block ids on each)."""
    return (
        sum(rank_digest(m, r, block_ids) for m, r in zip(manifests, regions, strict=True)) & _MASK
    )


def _part_digest(
    m: Manifest, region: np.ndarray, layer_index: int, part: Part, ids: np.ndarray, ratio: int
) -> int:
    units, keep = _row_units(m, part)
    if not keep.any():
        return 0
    view = _part_view(region, part, int(ids.max()) * ratio + ratio, layer_index)
    nbytes = part.rows * part.unit_bytes  # a unit's rows in order are its bytes
    weights = _weights(nbytes // 8 if nbytes % 8 == 0 else nbytes)
    key = _part_key(layer_index, part.name)
    step = max(1, _CHUNK_BYTES // max(1, ratio * part.units * nbytes))
    total = 0
    for first in range(0, ids.size, step):
        chunk = ids[first : first + step]
        kernel = chunk[:, None] * ratio + np.arange(ratio, dtype=np.int64)
        rows = np.ascontiguousarray(view[kernel][:, :, keep])  # (blocks, sub, units, rows, bytes)
        rows = rows.reshape(*rows.shape[:3], nbytes)
        words = rows.view("<u8") if nbytes % 8 == 0 else rows.astype(np.uint64)
        h = (words * weights).sum(axis=-1, dtype=np.uint64)
        ordinal = np.arange(first, first + chunk.size, dtype=np.uint64)
        ident = (
            key
            ^ (ordinal * _ORD)[:, None, None]
            ^ (np.arange(ratio, dtype=np.uint64) * _SUB)[None, :, None]
            ^ (units[keep] * _UNIT)[None, None, :]
        )
        total += int(_mix(h ^ _mix(ident)).sum(dtype=np.uint64))
    return total


def _row_units(m: Manifest, part: Part) -> tuple[np.ndarray, np.ndarray]:
    """Identity of each local TP unit (uint64) and whether this rank counts it.

    Sliceable parts are identified by global unit and counted on the first rank holding them;
    unsliceable ones (NHD K/V, unsectioned conv) are rank-local and carry the rank in their
    identity.
    """
    local = np.arange(part.units, dtype=np.int64)
    if not part.sliceable:
        ident = local.astype(np.uint64) ^ (np.full(part.units, m.tp_rank + 1, np.uint64) * _RANK)
        return ident, np.ones(part.units, dtype=bool)
    owned = owned_units(part.units_total, m.tp_size, m.tp_rank, f"{part.name}.units_total")
    if len(owned) != part.units:
        raise ManifestError(f"{part.name}.units", f"{part.units} != {len(owned)} owned units")
    glob = np.arange(owned.start, owned.stop, dtype=np.int64)
    first = np.array(
        [unit_holders(part.units_total, m.tp_size, int(u))[0] == m.tp_rank for u in glob]
    )
    return glob.astype(np.uint64), first


def _part_view(region: np.ndarray, part: Part, kernel_units: int, layer_index: int) -> np.ndarray:
    """Read-only (kernel unit, TP unit, row, byte) view of ``part`` over the first units."""
    end = (
        part.offset
        + (kernel_units - 1) * part.block_stride
        + (part.units - 1) * part.unit_stride
        + (part.rows - 1) * part.row_stride
        + part.unit_bytes
    )
    if part.offset < 0 or end > region.size:
        raise ManifestError(
            f"layers[{layer_index}].{part.name}",
            f"bytes up to {end} needed, region has {region.size}",
        )
    return as_strided(
        region[part.offset :],
        shape=(kernel_units, part.units, part.rows, part.unit_bytes),
        strides=(part.block_stride, part.unit_stride, part.row_stride, 1),
        writeable=False,
    )
