"""Map a request's block ids onto descriptor pairs: which remote bytes land where locally.

``plan_read`` is the heart of a pull: for each group it pairs the local and remote logical block
ids, expands attention ids to kernel blocks, and places every piece of every layer (only the TP
units this remote rank serves to this local rank) at its byte offset on both sides. Peers whose
block sizes or grouping differ map tokens instead (:mod:`.reblock`); ``plan_pull`` picks the way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.coalesce import coalesce as coalesce_plan
from kvxferd.descriptors.geometry import (
    check_geometry,
    check_request_ids,
    family,
    kernel_ids,
    kernel_ratio,
    layer_pairs,
    layer_parts,
    part_field,
)
from kvxferd.descriptors.pieces import Pieces, pair_pieces
from kvxferd.descriptors.plan import ReadPlan
from kvxferd.descriptors.reblock import ReblockGeometry, reblock_fields, reblock_geometry
from kvxferd.descriptors.tpslice import check_units, read_units
from kvxferd.errors import BlockIdError, IncompatiblePeerError, ManifestError
from kvxferd.wire import AttentionLayer, Manifest

_ATTN_FIELDS = ("index", "total_kv_heads", "head_size", "dtype", "head_layout", "head_size_v")
_MAMBA_FIELDS = ("index", "mamba_type", "conv_dtype", "ssm_dtype", "conv_layout")
_GROUP_FIELDS = ("kind", "sliding_window")
_PART_FIELDS = ("name", "units_total")


def _check_remote(remote: Manifest) -> None:
    """Geometry and TP-unit checks of the peer's manifest, its fields prefixed ``remote.``."""
    try:
        check_geometry(remote)
        check_units(remote)
    except ManifestError as exc:
        raise ManifestError(f"remote.{exc.field}", exc.reason) from exc


def compare_manifests(local: Manifest, remote: Manifest) -> dict[str, tuple[object, object]]:
    """Every field where two ranks' manifests disagree in a way that forbids exchanging blocks.

    Values are ``(local, remote)``. Empty means compatible. Pool sizes, regions, K/V order,
    packing, block sizes and the grouping of the same layers may differ (such peers re-block:
    tokens move, see :mod:`~kvxferd.descriptors.reblock`); the layers, their head geometry and
    dtypes may not, and under heterogeneous TP a part that is not ``sliceable`` may not need a
    slice (reported as ``<part>.sliceable``). A manifest that breaks the TP ownership rule
    raises ManifestError. Layers pair by position, or by model layer index when regrouped.
    """
    diff: dict[str, tuple[object, object]] = {}

    def cmp(field: str, a: object, b: object) -> None:
        if a != b:
            diff[field] = (a, b)

    cmp("version", local.version, remote.version)
    if diff:
        return diff
    paired = layer_pairs(local, remote)
    if paired is None:  # different layers: name the groups and layers that differ
        cmp("groups", len(local.groups), len(remote.groups))
        for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=False)):
            cmp(f"groups[{g}].layers", len(lg.layers), len(rg.layers))
        pairs = [
            (g, i, g, i)
            for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=False))
            for i in range(min(len(lg.layers), len(rg.layers)))
        ]
    else:
        pairs = paired[0]
    # re-blocking moves token rows, so per-token row splits may differ; block ids need them equal
    reblocks = paired is not None and bool(reblock_fields(local, remote))
    for g, i, rgi, ri in pairs:
        lg, rg = local.groups[g], remote.groups[rgi]
        ll, rl = lg.layers[i], rg.layers[ri]
        for f in _GROUP_FIELDS:
            cmp(f"groups[{g}].{f}", getattr(lg, f), getattr(rg, f))
        lf = f"groups[{g}].layers[{i}]"
        if type(ll) is not type(rl):
            cmp(f"{lf}.type", type(ll).__name__, type(rl).__name__)
            continue
        fields = _ATTN_FIELDS if isinstance(ll, AttentionLayer) else _MAMBA_FIELDS
        for f in fields:
            cmp(f"{lf}.{f}", getattr(ll, f), getattr(rl, f))
        lparts, rparts = layer_parts(ll), layer_parts(rl)
        cmp(f"{lf}.conv", len(lparts) - 1, len(rparts) - 1)
        # attention parts hold kernel_block_size tokens: compare their bytes per token
        attn = fields is _ATTN_FIELDS
        lk, rk = (lg.kernel_block_size, rg.kernel_block_size) if attn else (1, 1)
        for (name, lp), (_n, rp) in zip(lparts, rparts, strict=False):
            for f in _PART_FIELDS:
                cmp(f"{lf}.{name}.{f}", getattr(lp, f), getattr(rp, f))
            if not reblocks:
                cmp(f"{lf}.{name}.rows", lp.rows, rp.rows)
            if lp.unit_bytes * lp.rows * rk != rp.unit_bytes * rp.rows * lk:
                diff[f"{lf}.{name}.unit_bytes"] = (lp.unit_bytes, rp.unit_bytes)
    if diff:
        return diff
    check_units(local)
    _check_remote(remote)
    ltp, rtp = (local.tp_size, local.tp_rank), (remote.tp_size, remote.tp_rank)
    for g, i, rgi, ri in pairs:
        ll, rl = local.groups[g].layers[i], remote.groups[rgi].layers[ri]
        for (name, lp), (_n, rp) in zip(layer_parts(ll), layer_parts(rl), strict=True):
            if read_units(lp, rp, ltp, rtp)[2]:
                diff[f"{part_field(g, i, name)}.sliceable"] = (lp.sliceable, rp.sliceable)
    return diff


@dataclass(frozen=True, eq=False)
class ReadGeometry:
    """All of reading from one remote rank that does not depend on the request.

    Built (and validated) once per peer by :func:`read_geometry`, e.g. at handshake; then
    :meth:`plan` maps each request with numpy only.
    """

    local_blocks: int
    remote_blocks: int
    ratios: tuple[int, ...]
    is_attention: tuple[bool, ...]
    pieces: tuple[Pieces, ...]
    reblock: ReblockGeometry | None = None
    """Set when the sides' block sizes or grouping differ: requests map tokens, not block ids."""

    def check_pairs(
        self,
        local_ids: Sequence[np.ndarray],
        remote_ids: Sequence[np.ndarray],
        *,
        local_checked: bool = False,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Validated (local, remote) logical ids per group; BlockIdError names the bad field.
        ``local_checked``: the local ids were validated once for the whole pull (one check,
        not one per prefill rank); only their group count is rechecked here."""
        n = len(self.ratios)
        if local_checked:
            if len(local_ids) != n:
                raise BlockIdError("block_ids", f"{len(local_ids)} id lists for {n} groups")
            lids = [np.asarray(a, dtype=np.int64) for a in local_ids]
        else:
            lids = check_request_ids(self.local_blocks, n, local_ids, "block_ids")
        rids = check_request_ids(self.remote_blocks, n, remote_ids, "remote_block_ids")
        for g, (a, b) in enumerate(zip(lids, rids, strict=True)):
            if a.size != b.size:
                raise BlockIdError(
                    f"remote_block_ids[{g}]", f"{b.size} remote ids for {a.size} in block_ids[{g}]"
                )
        return list(zip(lids, rids, strict=True))

    def plan(
        self,
        local_ids: Sequence[np.ndarray],
        remote_ids: Sequence[np.ndarray],
        *,
        coalesce: bool = True,
        local_checked: bool = False,
    ) -> ReadPlan:
        """The descriptor pairs of one request (see :func:`plan_read`; ``local_checked`` as
        :meth:`check_pairs`).

        Block ids pair up only between equal block sizes: with a :attr:`reblock` geometry this
        raises IncompatiblePeerError naming the sizes (use :func:`plan_pull`).
        """
        if self.reblock is not None:
            raise IncompatiblePeerError(self.reblock.block_diff)
        cols: list[list[np.ndarray]] = [[] for _ in range(5)]
        kv_bytes = state_bytes = 0
        pairs = self.check_pairs(local_ids, remote_ids, local_checked=local_checked)
        for g, (a, b) in enumerate(pairs):
            p = self.pieces[g]
            if a.size == 0 or p.length.size == 0:
                continue
            kl, kr = kernel_ids(a, self.ratios[g]), kernel_ids(b, self.ratios[g])
            for col, part in zip(cols, p.expand(kl, kr), strict=True):
                col.append(part)
            if self.is_attention[g]:
                kv_bytes += p.bytes_per_unit * kl.size
            else:
                state_bytes += p.bytes_per_unit * kl.size
        if not cols[0]:
            return ReadPlan.empty()
        lreg, loff, rreg, roff, ln = (np.concatenate(c) for c in cols)
        plan = ReadPlan(lreg, loff, rreg, roff, ln, kv_bytes, state_bytes)
        return coalesce_plan(plan) if coalesce else plan


def read_geometry(local: Manifest, remote: Manifest) -> ReadGeometry:
    """Validate a (local rank, remote rank) pair and precompute its per-block-unit pieces.

    Raises :class:`IncompatiblePeerError` (with :func:`compare_manifests`' fields) or
    :class:`ManifestError` (a ``remote.`` prefix names the peer's manifest).
    """
    check_geometry(local)
    _check_remote(remote)
    diff = compare_manifests(local, remote)
    if diff:
        raise IncompatiblePeerError(diff)
    groups = local.groups
    reblocked = reblock_fields(local, remote)
    if reblocked:
        return ReadGeometry(
            local_blocks=local.num_blocks,
            remote_blocks=remote.num_blocks,
            ratios=tuple(kernel_ratio(gr, f"groups[{g}]") for g, gr in enumerate(groups)),
            is_attention=tuple(family(gr) == "attention" for gr in groups),
            pieces=(),
            reblock=reblock_geometry(local, remote),
        )
    return ReadGeometry(
        local_blocks=local.num_blocks,
        remote_blocks=remote.num_blocks,
        ratios=tuple(kernel_ratio(gr, f"groups[{g}]") for g, gr in enumerate(groups)),
        is_attention=tuple(family(gr) == "attention" for gr in groups),
        pieces=tuple(pair_pieces(local, remote, g) for g in range(len(groups))),
    )


def plan_read(
    local: Manifest,
    remote: Manifest,
    local_ids: Sequence[np.ndarray],
    remote_ids: Sequence[np.ndarray],
    *,
    coalesce: bool = True,
) -> ReadPlan:
    """The descriptor pairs this local rank READs from this remote rank for one request.

    ``local_ids[g][k]`` (logical block ids of group ``g``) receives ``remote_ids[g][k]``. Only
    the TP units this remote rank serves are included, so the plan may be empty. Raises
    :class:`IncompatiblePeerError`, :class:`BlockIdError` (field ``block_ids[g][k]`` or
    ``remote_block_ids[g][k]``) or :class:`ManifestError`. A caller that maps many requests
    against one peer keeps :func:`read_geometry` and calls its ``plan`` instead.
    """
    return read_geometry(local, remote).plan(local_ids, remote_ids, coalesce=coalesce)


def plan_pull(
    geometry: ReadGeometry,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    num_tokens: int = -1,
    remote_tokens: int = 0,
    *,
    local_checked: bool = False,
) -> ReadPlan:
    """The coalesced plan of one pull from one remote rank, whichever way the ids map.

    Equal block sizes: ``local_ids[g][k]`` receives ``remote_ids[g][k]`` (pairs whose local id
    is -1 are skipped; ``num_tokens`` is not used), exactly :meth:`ReadGeometry.plan`. Different
    block sizes or grouping: tokens ``[0, num_tokens)`` (-1: ``remote_tokens``, the ticket's)
    move between the sides' own block lists, see :meth:`ReblockGeometry.plan`. Raises
    BlockIdError naming the field. ``local_checked``: the local ids were validated for the
    whole pull already (kvxferd.sidecar.pull_request), so each rank's plan skips that check.
    """
    if geometry.reblock is not None:
        return geometry.reblock.plan(local_ids, remote_ids, num_tokens, remote_tokens)
    return geometry.plan(*id_pairs(local_ids, remote_ids), local_checked=local_checked)


def id_pairs(
    local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-group (local, remote) id arrays without the pairs whose local id is -1 (already
    held here); BlockIdError when the groups or their lengths differ."""
    if len(local_ids) != len(remote_ids):
        raise BlockIdError(
            "remote_block_ids", f"{len(remote_ids)} groups in the ticket, {len(local_ids)} here"
        )
    out_l, out_r = [], []
    for g, (lo, re) in enumerate(zip(local_ids, remote_ids, strict=True)):
        if len(lo) != len(re):
            raise BlockIdError(f"block_ids[{g}]", f"{len(lo)} local ids for {len(re)} ticket ids")
        lo_a = np.asarray(lo, dtype=np.int64)
        re_a = np.asarray(re, dtype=np.int64)
        keep = lo_a >= 0
        out_l.append(lo_a[keep])
        out_r.append(re_a[keep])
    return out_l, out_r
