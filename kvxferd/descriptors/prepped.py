"""Prepared descriptor tables of one peer pair, and a request as index arrays into them.

The seed-004 views on the data path: once per peer epoch, every piece (:mod:`.pieces`) of every
group is expanded over all block units of each side into a local and a remote table (a
transport prepares them once); a request then only computes int32 indices, ``local[li[k]]``
receives ``remote[ri[k]]``. Groups with the same pieces share table rows (the groups of a pooled
hybrid all live in the same pages), and an attention group whose kernel blocks are adjacent
inside a logical block gets one row per logical block instead of one per kernel block.

Index plans are block granular: adjacent blocks are not merged (the coalesced :class:`ReadPlan`
does that); :meth:`PreppedGeometry.cheaper` coalesces an index plan's rows, so the sidecar posts
whichever has fewer descriptors and never more than the coalesced plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.coalesce import coalesce
from kvxferd.descriptors.geometry import kernel_ids
from kvxferd.descriptors.mapping import ReadGeometry, id_pairs
from kvxferd.descriptors.pieces import Pieces
from kvxferd.descriptors.plan import ReadPlan
from kvxferd.errors import IncompatiblePeerError

MAX_ROWS = 1 << 21
"""Largest table (rows per side) :func:`prepped_geometry` builds; larger pairs are not prepped."""


@dataclass(frozen=True, eq=False)
class IndexPlan:
    """One request as index pairs: ``local[local_idx[k]]`` receives ``remote[remote_idx[k]]``."""

    local_idx: np.ndarray
    remote_idx: np.ndarray
    kv_bytes: int
    state_bytes: int
    runs: int
    """Index pairs that start a run of adjacent blocks on both sides (what coalescing keeps)."""

    @property
    def num_descriptors(self) -> int:
        """Index pairs (one descriptor on each side per pair)."""
        return int(self.local_idx.size)

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return self.kv_bytes + self.state_bytes


@dataclass(frozen=True, eq=False)
class _GroupRows:
    """Where group ``g``'s rows sit: ``base + piece * units + unit`` on each side."""

    local_base: int
    remote_base: int
    pieces: int
    local_units: int
    remote_units: int
    ratio: int  # kernel blocks per table unit: 1 (kernel rows) or the group's ratio (logical)
    mergeable: int  # pieces adjacent from one table unit to the next on both sides
    bytes_per_unit: int  # bytes of one logical block of the group
    attention: bool


@dataclass(frozen=True, eq=False)
class PreppedGeometry:
    """The prepared tables of one (local rank, remote rank) pair and how groups index them.

    ``local``/``remote`` are ``(region, offset, length)`` int64 arrays; add each side's region
    base addresses to get the table a transport prepares.
    """

    local: tuple[np.ndarray, np.ndarray, np.ndarray]
    remote: tuple[np.ndarray, np.ndarray, np.ndarray]
    groups: tuple[_GroupRows | None, ...]
    geometry: ReadGeometry

    @property
    def num_rows(self) -> int:
        """Rows of the local table (the remote one may differ: pool sizes may)."""
        return int(self.local[2].size)

    def addresses(
        self, local_bases: Sequence[int], remote_bases: Sequence[int]
    ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``((local addrs, lens), (remote addrs, lens))`` for the transport to prepare."""
        lb = np.asarray(local_bases, dtype=np.int64)
        rb = np.asarray(remote_bases, dtype=np.int64)
        (lr, lo, ll), (rr, ro, rl) = self.local, self.remote
        return (lb[lr] + lo, ll), (rb[rr] + ro, rl)

    def plan(
        self, local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]
    ) -> IndexPlan:
        """A request's index pairs, validated like :func:`~.mapping.plan_pull` (local id -1
        skips the pair; BlockIdError names the field)."""
        lids, rids = id_pairs(local_ids, remote_ids)
        li: list[np.ndarray] = []
        ri: list[np.ndarray] = []
        kv = state = runs = 0
        for g, (a, b) in enumerate(self.geometry.check_pairs(lids, rids)):
            rows = self.groups[g]
            if rows is None or a.size == 0:
                continue
            ratio = self.geometry.ratios[g] // rows.ratio
            kl, kr = kernel_ids(a, ratio), kernel_ids(b, ratio)
            p = np.arange(rows.pieces, dtype=np.int64)[:, None]
            li.append((rows.local_base + p * rows.local_units + kl[None, :]).ravel())
            ri.append((rows.remote_base + p * rows.remote_units + kr[None, :]).ravel())
            adjacent = (np.diff(kl) == 1) & (np.diff(kr) == 1)
            runs += rows.pieces * kl.size - rows.mergeable * int(adjacent.sum())
            if rows.attention:
                kv += rows.bytes_per_unit * a.size
            else:
                state += rows.bytes_per_unit * a.size
        if not li:
            z = np.zeros(0, dtype=np.int32)
            return IndexPlan(z, z, 0, 0, 0)
        return IndexPlan(
            np.concatenate(li).astype(np.int32),
            np.concatenate(ri).astype(np.int32),
            kv,
            state,
            runs,
        )

    def rows(self, idx: IndexPlan) -> ReadPlan:
        """The byte pairs ``idx`` addresses (its table rows), one pair per index pair."""
        (lr, lo, ll), (rr, ro, _) = self.local, self.remote
        li, ri = idx.local_idx, idx.remote_idx
        return ReadPlan(lr[li], lo[li], rr[ri], ro[ri], ll[li], idx.kv_bytes, idx.state_bytes)

    def cheaper(self, idx: IndexPlan) -> ReadPlan | None:
        """The coalesced plan of ``idx``'s rows if it has fewer descriptors than ``idx`` (post
        it as tables), else None (post by index). Either way no more descriptors than the
        coalesced :func:`~.mapping.plan_pull` of the same request: it is that plan."""
        if idx.num_descriptors == 0:
            return None
        merged = coalesce(self.rows(idx))
        return merged if merged.num_descriptors < idx.num_descriptors else None


def _logical(p: Pieces, ratio: int) -> bool:
    """Whether a logical block's kernel blocks are adjacent for every piece, on both sides."""
    return ratio > 1 and bool(((p.local_stride == p.length) & (p.remote_stride == p.length)).all())


def _expand(region, offset, stride, length, units: int):
    u = np.arange(units, dtype=np.int64)
    return (
        np.repeat(region, units),
        (offset[:, None] + stride[:, None] * u[None, :]).ravel(),
        np.repeat(length, units),
    )


def prepped_geometry(geometry: ReadGeometry, max_rows: int = MAX_ROWS) -> PreppedGeometry | None:
    """The prepared tables for a peer pair, or None when it maps tokens (re-blocking) or its
    tables would exceed ``max_rows`` rows (the plain coalesced path serves such peers)."""
    if geometry.reblock is not None:
        return None
    local_cols: list[list[np.ndarray]] = [[], [], []]
    remote_cols: list[list[np.ndarray]] = [[], [], []]
    seen: dict[tuple, _GroupRows] = {}
    groups: list[_GroupRows | None] = []
    lrows = rrows = 0
    for g, p in enumerate(geometry.pieces):
        if p.length.size == 0:
            groups.append(None)
            continue
        ratio = geometry.ratios[g]
        per = ratio if _logical(p, ratio) else 1
        attention = geometry.is_attention[g]
        key = (per, ratio, attention, *(a.tobytes() for a in _fields(p)))
        if key in seen:
            groups.append(seen[key])
            continue
        lunits = geometry.local_blocks * ratio // per
        runits = geometry.remote_blocks * ratio // per
        lrows_g, rrows_g = p.length.size * lunits, p.length.size * runits
        if max(lrows + lrows_g, rrows + rrows_g) > max_rows:
            return None
        length = p.length * per
        for cols, parts in (
            (local_cols, _expand(p.local_region, p.local_offset, p.local_stride * per, length,
                                 lunits)),
            (remote_cols, _expand(p.remote_region, p.remote_offset, p.remote_stride * per,
                                  length, runits)),
        ):  # fmt: skip
            for c, a in zip(cols, parts, strict=True):
                c.append(a)
        mergeable = int(((p.local_stride == p.length) & (p.remote_stride == p.length)).sum())
        rows = _GroupRows(lrows, rrows, p.length.size, lunits, runits, per, mergeable,
                          p.bytes_per_unit * ratio, attention)  # fmt: skip
        seen[key] = rows
        groups.append(rows)
        lrows += lrows_g
        rrows += rrows_g
    if not lrows:
        return None
    if max(lrows, rrows) >= 1 << 31:  # int32 indices
        raise IncompatiblePeerError({"prepped_rows": (lrows, rrows)})
    return PreppedGeometry(
        tuple(np.concatenate(c) for c in local_cols),  # type: ignore[arg-type]
        tuple(np.concatenate(c) for c in remote_cols),  # type: ignore[arg-type]
        tuple(groups),
        geometry,
    )


def _fields(p: Pieces) -> tuple[np.ndarray, ...]:
    return (p.local_region, p.local_offset, p.local_stride, p.remote_region, p.remote_offset,
            p.remote_stride, p.length)  # fmt: skip
