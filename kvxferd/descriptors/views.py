"""Descriptor views: every block unit of every layer as a flat (region, offset, length) table.

The same pooled regions are seen through two views (seed 004): the FA view addresses kernel
blocks of attention layers, the Mamba view logical blocks of mamba layers; which one applies to
a block depends on the group that owns it. A view has *slots* (one per run of adjacent parts in
a region, e.g. a blocks-first ``[K|V]`` or a ``[conv|ssm]`` page without its padding) and one
descriptor per slot and block unit: descriptor id ``base + slot * num_units + unit``, the order
in which a transport would prepare the list once at registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvxferd.descriptors.geometry import (
    check_block_ids,
    check_geometry,
    family,
    kernel_ids,
    kernel_ratio,
)
from kvxferd.descriptors.pieces import whole_pieces
from kvxferd.errors import BlockIdError
from kvxferd.wire import Manifest


@dataclass(frozen=True, eq=False)
class DescriptorView:
    """One placement kind (attention at one kernel ratio, or mamba) over the pooled regions.

    ``slot_*`` describe slots at block unit 0; ``region``/``offset``/``length`` are the full
    slot-major table of ``num_slots * num_units`` descriptors starting at id ``base``.
    """

    name: str
    family: Literal["attention", "mamba"]
    ratio: int
    num_units: int
    base: int
    slot_region: np.ndarray
    slot_offset: np.ndarray
    slot_stride: np.ndarray
    slot_length: np.ndarray
    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    @property
    def num_slots(self) -> int:
        """Slots (descriptor runs per block unit) of the view."""
        return int(self.slot_region.size)

    @property
    def num_descriptors(self) -> int:
        """Descriptors in the view's table."""
        return self.num_slots * self.num_units


@dataclass(frozen=True, eq=False)
class Views:
    """All views of a manifest, and which view and slots each group uses."""

    views: tuple[DescriptorView, ...]
    group_view: tuple[int, ...]
    group_slots: tuple[np.ndarray, ...]
    group_ratio: tuple[int, ...]
    num_blocks: int

    @property
    def num_descriptors(self) -> int:
        """Descriptors of all views together (the length of :meth:`table`)."""
        return sum(v.num_descriptors for v in self.views)

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(region, offset, length)`` of every descriptor, indexed by descriptor id."""
        if not self.views:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z
        return tuple(  # type: ignore[return-value]
            np.concatenate([getattr(v, f) for v in self.views])
            for f in ("region", "offset", "length")
        )


def _expand(
    slot_region: np.ndarray,
    slot_offset: np.ndarray,
    slot_stride: np.ndarray,
    slot_length: np.ndarray,
    num_units: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot-major table: descriptor ``s * num_units + u`` is slot ``s`` at block unit ``u``."""
    units = np.arange(num_units, dtype=np.int64)
    region = np.repeat(slot_region, num_units)
    offset = (slot_offset[:, None] + slot_stride[:, None] * units[None, :]).ravel()
    length = np.repeat(slot_length, num_units)
    return region, offset, length


def build_views(manifest: Manifest) -> Views:
    """The FA and Mamba views of a manifest (one FA view per distinct kernel ratio).

    Groups with identical slots share them (e.g. the mamba groups of a pooled hybrid model, or
    a sliding-window group laid out like the full-attention group).
    """
    check_geometry(manifest)
    keys = []
    for g, group in enumerate(manifest.groups):
        keys.append((family(group), kernel_ratio(group, f"groups[{g}]")))
    order = sorted(set(keys), key=lambda k: (k[0] != "attention", k[1]))
    group_view = [order.index(k) for k in keys]
    group_slots: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * len(keys)
    views, base = [], 0
    for v, (fam, ratio) in enumerate(order):
        members = [g for g, k in enumerate(group_view) if k == v]
        rows = []
        for g in members:
            p = whole_pieces(manifest, g)
            rows.append(np.stack([p.local_region, p.local_offset, p.local_stride, p.length], 1))
        allrows = np.concatenate(rows) if rows else np.zeros((0, 4), dtype=np.int64)
        slots, inverse = np.unique(allrows, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        start = 0
        for g, r in zip(members, rows, strict=True):
            group_slots[g] = np.sort(inverse[start : start + len(r)])
            start += len(r)
        num_units = manifest.num_blocks * ratio
        sr, so, ss, sl = (np.ascontiguousarray(slots[:, j], dtype=np.int64) for j in range(4))
        region, offset, length = _expand(sr, so, ss, sl, num_units)
        name = "fa" if fam == "attention" else "mamba"
        if sum(1 for f, _r in order if f == fam) > 1:
            name = f"{name}_r{ratio}"
        views.append(
            DescriptorView(
                name, fam, ratio, num_units, base, sr, so, ss, sl, region, offset, length
            )
        )
        base += sl.size * num_units
    return Views(
        tuple(views),
        tuple(group_view),
        tuple(group_slots),
        tuple(k[1] for k in keys),
        manifest.num_blocks,
    )


def desc_ids(
    views: Views, group_index: int, logical_block_ids: object, field: str = "block_ids"
) -> np.ndarray:
    """Descriptor ids of logical blocks of one group: slot-major, then kernel block order.

    Attention ids expand to kernel blocks ``L * ratio + j``; mamba ids map one to one.
    """
    if not 0 <= group_index < len(views.group_view):
        raise BlockIdError(field, f"no group {group_index} (manifest has {len(views.group_view)})")
    field = f"{field}[{group_index}]"
    ids = check_block_ids(views.num_blocks, logical_block_ids, field)
    view = views.views[views.group_view[group_index]]
    kern = kernel_ids(ids, views.group_ratio[group_index])
    slots = views.group_slots[group_index]
    return (view.base + slots[:, None] * view.num_units + kern[None, :]).ravel()
