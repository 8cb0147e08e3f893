"""Descriptor tables as NIXL wants them: Nx3 uint64 ``(addr, len, device)`` and int32 indices.

Callers hand (addr, len) pairs in whatever shape the descriptors layer produced; these helpers
normalise and check them so NIXL never sees a malformed list.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvxferd.errors import DescriptorError

TableLike = np.ndarray | tuple[np.ndarray, np.ndarray] | Sequence[np.ndarray]


def as_xfer_table(table: TableLike, device_id: int = 0, field: str = "descs") -> np.ndarray:
    """Return a C-contiguous Nx3 uint64 ``(addr, len, device_id)`` table.

    Accepts an Nx2 ``(addr, len)`` array, an Nx3 array (device column kept) or a pair of 1-D
    ``addrs``, ``lens`` arrays. Rejects empty tables, negative values and zero lengths.
    """
    if isinstance(table, tuple | list):
        if len(table) != 2:
            raise DescriptorError(f"{field}: expected (addrs, lens), got {len(table)} arrays")
        addrs, lens = (np.asarray(a) for a in table)
        if addrs.ndim != 1 or addrs.shape != lens.shape:
            raise DescriptorError(
                f"{field}: addrs and lens must be 1-D of equal length, "
                f"got {addrs.shape} and {lens.shape}"
            )
        if _well_formed(addrs, lens):  # every READ's path: one copy, no intermediate table
            out = np.empty((addrs.size, 3), dtype=np.uint64)
            out[:, 0], out[:, 1], out[:, 2] = addrs, lens, device_id
            return out
        arr = np.stack([addrs, lens], axis=1)  # below: which check fails, and where
    else:
        arr = np.asarray(table)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise DescriptorError(f"{field}: expected an Nx2 or Nx3 table, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise DescriptorError(f"{field}: descriptor table is empty")
    if arr.dtype.kind not in "iu":
        raise DescriptorError(f"{field}: descriptor table must be integers, got {arr.dtype}")
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise DescriptorError(f"{field}: negative address or length")
    out = np.empty((arr.shape[0], 3), dtype=np.uint64)
    out[:, :2] = arr[:, :2]
    out[:, 2] = arr[:, 2] if arr.shape[1] == 3 else device_id
    zero = np.flatnonzero(out[:, 1] == 0)
    if zero.size:
        raise DescriptorError(f"{field}[{int(zero[0])}]: zero-length descriptor")
    return out


def _well_formed(addrs: np.ndarray, lens: np.ndarray) -> bool:
    """Non-empty integer columns, no negative address, no zero or negative length."""
    return (
        addrs.size > 0
        and addrs.dtype.kind in "iu"
        and lens.dtype.kind in "iu"
        and int(addrs.min()) >= 0
        and int(lens.min()) > 0
    )


def check_pairs(local: np.ndarray, remote: np.ndarray) -> None:
    """Local and remote Nx3 tables must pair row by row with equal lengths."""
    if local.shape[0] != remote.shape[0]:
        raise DescriptorError(
            f"local has {local.shape[0]} descriptors, remote has {remote.shape[0]}"
        )
    diff = np.flatnonzero(local[:, 1] != remote[:, 1])
    if diff.size:
        i = int(diff[0])
        raise DescriptorError(
            f"descriptor {i}: local length {int(local[i, 1])} != remote length {int(remote[i, 1])}"
        )


def as_indices(idx: np.ndarray | Sequence[int], count: int, field: str) -> np.ndarray:
    """Return ``idx`` as a C-contiguous 1-D int32 array, every entry in ``[0, count)``."""
    arr = np.asarray(idx)
    if arr.ndim != 1 or arr.size == 0:
        raise DescriptorError(f"{field}: expected a non-empty 1-D index array, got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise DescriptorError(f"{field}: indices must be integers, got {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= count))
    if bad.size:
        i = int(bad[0])
        raise DescriptorError(f"{field}[{i}] = {int(arr[i])} is outside [0, {count})")
    return np.ascontiguousarray(arr, dtype=np.int32)
