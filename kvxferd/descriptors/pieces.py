"""Pieces: what one block unit of one group contributes to a transfer, before block expansion.

A piece copies ``length`` bytes from ``remote_offset + u_r * remote_stride`` in the remote region
to ``local_offset + u_l * local_stride`` in the local region, for every pair of block units
``(u_l, u_r)`` the request maps. Pieces that continue each other on both sides for every block
unit (same regions, same strides, adjacent at unit 0) are merged, which makes a blocks-first
``[K|V]``, a pack of attention layers or a ``[conv|ssm]`` page a single piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.coalesce import merge_runs
from kvxferd.descriptors.geometry import LayerPair, layer_parts, part_field
from kvxferd.descriptors.tpslice import read_units
from kvxferd.errors import IncompatiblePeerError
from kvxferd.wire import Manifest, Part


@dataclass(frozen=True, eq=False)
class Pieces:
    """Per-block-unit copy pattern of one group (int64 arrays of equal length)."""

    local_region: np.ndarray
    local_offset: np.ndarray
    local_stride: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    remote_stride: np.ndarray
    length: np.ndarray

    @property
    def bytes_per_unit(self) -> int:
        """Bytes one pair of block units moves."""
        return int(self.length.sum())

    def expand(self, local_units: np.ndarray, remote_units: np.ndarray) -> tuple[np.ndarray, ...]:
        """Every piece over the block unit pairs ``(local_units[k], remote_units[k])``, piece
        by piece: the ``(local region, local offset, remote region, remote offset, length)``
        columns of the descriptor pairs."""
        n = local_units.size
        return (
            np.repeat(self.local_region, n),
            (self.local_offset[:, None] + self.local_stride[:, None] * local_units).ravel(),
            np.repeat(self.remote_region, n),
            (self.remote_offset[:, None] + self.remote_stride[:, None] * remote_units).ravel(),
            np.repeat(self.length, n),
        )


class _Rows:
    """Collects TP-unit pieces part by part; numpy work happens once, in :meth:`pieces`."""

    def __init__(self) -> None:
        self.scalars: list[tuple[int, ...]] = []  # per part: both sides' geometry, unit bytes
        self.lidx: list[np.ndarray] = []
        self.ridx: list[np.ndarray] = []

    def add(self, lreg: int, lp: Part, lidx: np.ndarray, rreg: int, rp: Part, ridx) -> None:
        """The units ``lidx`` of local part ``lp`` receive units ``ridx`` of remote ``rp``.

        A part with rows (packed K|V) adds one piece per row; merging joins K and V rows again.
        """
        for r in range(lp.rows):
            self.scalars.append(
                (
                    lreg,
                    lp.offset + r * lp.row_stride,
                    lp.unit_stride,
                    lp.block_stride,
                    rreg,
                    rp.offset + r * rp.row_stride,
                    rp.unit_stride,
                    rp.block_stride,
                    lp.unit_bytes,
                )
            )
            self.lidx.append(lidx)
            self.ridx.append(ridx)

    def pieces(self) -> Pieces:
        """One piece per TP unit, then adjacent pieces merged."""
        if not self.scalars:
            z = np.zeros(0, dtype=np.int64)
            return Pieces(z, z, z, z, z, z, z)
        counts = np.fromiter((i.size for i in self.lidx), dtype=np.int64, count=len(self.lidx))
        cols = np.repeat(np.asarray(self.scalars, dtype=np.int64), counts, axis=0).T
        lreg, loff, lus, lbs, rreg, roff, rus, rbs, ln = cols
        loff = loff + np.concatenate(self.lidx) * lus
        roff = roff + np.concatenate(self.ridx) * rus
        (lreg, rreg, lbs, rbs), loff, roff, ln = merge_runs((lreg, rreg, lbs, rbs), loff, roff, ln)
        return Pieces(lreg, loff, lbs, rreg, roff, rbs, ln)


def whole_pieces(manifest: Manifest, g: int) -> Pieces:
    """Every byte of every part of group ``g`` (all units this rank holds), local = remote."""
    rows = _Rows()
    for layer in manifest.groups[g].layers:
        for _name, p in layer_parts(layer):
            idx = np.arange(p.units, dtype=np.int64)
            rows.add(layer.region, p, idx, layer.region, p, idx)
    return rows.pieces()


def pair_pieces(local: Manifest, remote: Manifest, g: int) -> Pieces:
    """What this local rank reads of group ``g`` from this remote rank (manifests compared).

    Each TP unit the local rank holds and this remote rank serves becomes a piece at its
    rank-relative position on each side (the global unit index is the same on both). Raises
    :class:`IncompatiblePeerError` naming every part that would need a slice it does not allow.
    """
    n = len(local.groups[g].layers)
    return layer_pieces(local, remote, [(g, i, g, i) for i in range(n)])


def layer_pieces(local: Manifest, remote: Manifest, pairs: list[LayerPair]) -> Pieces:
    """:func:`pair_pieces` over explicit ``(local group, layer, remote group, layer)`` pairs."""
    ltp, rtp = (local.tp_size, local.tp_rank), (remote.tp_size, remote.tp_rank)
    rows, bad = _Rows(), {}
    for g, i, rg, ri in pairs:
        ll, rl = local.groups[g].layers[i], remote.groups[rg].layers[ri]
        for (name, lp), (_n, rp) in zip(layer_parts(ll), layer_parts(rl), strict=True):
            lidx, ridx, unsliceable = read_units(lp, rp, ltp, rtp)
            if unsliceable:
                bad[f"{part_field(g, i, name)}.sliceable"] = (lp.sliceable, rp.sliceable)
            elif lidx.size:
                rows.add(ll.region, lp, lidx, rl.region, rp, ridx)
    if bad:
        raise IncompatiblePeerError(bad)
    return rows.pieces()
