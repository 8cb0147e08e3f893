"""Re-blocking: map token ranges, not block ids, between ranks whose block sizes differ.

Hybrid models size their blocks per TP (the Mamba page shrinks with TP), so a prefill at TP 4
and a decode at TP 1 may hold the same tokens in blocks of different sizes. Attention K/V of
token ``t`` lives in logical block ``t // block_size`` of the request (the list entry covering
it), kernel block ``(t % block_size) // kernel_block_size``, token row ``t % kernel_block_size``.
A *token piece* is the run of one TP unit (HND: one head, whose tokens are contiguous within a
kernel block) or of a whole NHD part (K, V apart: a token row holds every head; NHD packed K|V
rows are refused) that one token occupies:
token row ``tau`` of block unit ``u`` is ``row`` bytes at ``offset + u * stride + tau * step``
(``step == row`` unless the part has per-token rows: vLLM's packed K|V puts ``row_stride``
between a head's token rows, and such rows move one token at a time).
Tokens ``[0, n)`` (a sliding window: its last ``sliding_window`` tokens) are cut at both sides'
kernel block boundaries into segments, and every segment moves once per token piece. Mamba state
moves as one block: the last listed block of each side's mamba group. The sides may group the
same layers differently (vLLM groups hybrid layers by page size, which follows the attention
pack size): layers pair by model layer index, each using its own side's group's block list.

Block-id lists of attention groups end at the block of the side's last token: a list shorter
than ``ceil(tokens / block_size)`` covers the request's last blocks (a sliding window), a list
of that length or longer starts at block 0. Local id -1 skips the tokens of that block (already
cached); a token to move whose remote block is -1 or unlisted is a BlockIdError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.coalesce import coalesce as coalesce_plan
from kvxferd.descriptors.geometry import (
    LayerPair,
    family,
    kernel_ratio,
    layer_pairs,
    layer_parts,
    part_field,
)
from kvxferd.descriptors.pieces import Pieces, layer_pieces
from kvxferd.descriptors.plan import ReadPlan
from kvxferd.descriptors.tpslice import read_units
from kvxferd.errors import BlockIdError, IncompatiblePeerError, ManifestError
from kvxferd.wire import DTYPE_BYTES, AttentionLayer, Manifest, Part


def reblock_fields(local: Manifest, remote: Manifest) -> dict[str, tuple[object, object]]:
    """Why block ids cannot pair up between two compared manifests (empty: they can).

    Groups whose ``block_size``/``kernel_block_size`` differ, or ``groups`` when the same
    layers are grouped differently (vLLM groups hybrid layers by page size).
    """
    paired = layer_pairs(local, remote)
    if paired is not None and paired[1]:
        return {"groups": (len(local.groups), len(remote.groups))}
    diff: dict[str, tuple[object, object]] = {}
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=False)):
        for f in ("block_size", "kernel_block_size"):
            a, b = getattr(lg, f), getattr(rg, f)
            if a != b:
                diff[f"groups[{g}].{f}"] = (a, b)
    return diff


@dataclass(frozen=True, eq=False)
class TokenPieces:
    """Per-token copy pattern of one attention group (int64 arrays of equal length).

    Token row ``tau`` of local block unit ``u_l`` (``row`` bytes at ``local_offset + u_l *
    local_stride + tau * local_step``) receives the same token's row of remote block unit ``u_r``.
    """

    local_region: np.ndarray
    local_offset: np.ndarray
    local_stride: np.ndarray
    remote_region: np.ndarray
    remote_offset: np.ndarray
    remote_stride: np.ndarray
    row: np.ndarray
    local_step: np.ndarray
    remote_step: np.ndarray


def _row_bytes(layer: AttentionLayer, p: Part, kbs: int, field: str) -> tuple[int, int]:
    """(bytes of one token row, bytes between token rows): of one TP unit (HND), or of the
    whole part (NHD), checked. A part with per-token rows (packed K|V; HND only, the caller
    refuses NHD ones) has ``kbs`` rows."""
    head = layer.head_size * DTYPE_BYTES[layer.dtype]
    if p.rows > 1:
        size = layer.head_size_v if p.name == "v" and layer.head_size_v else layer.head_size
        if p.rows != kbs or p.unit_bytes != size * DTYPE_BYTES[layer.dtype]:
            raise ManifestError(
                f"{field}.rows",
                f"{p.rows} rows of {p.unit_bytes} bytes are not kernel_block_size {kbs} token "
                f"rows of one head",
            )
        return p.unit_bytes, p.row_stride
    if layer.head_layout == "HND":
        if p.unit_bytes != kbs * head:
            raise ManifestError(
                f"{field}.unit_bytes",
                f"{p.unit_bytes} bytes is not kernel_block_size {kbs} x head_size "
                f"{layer.head_size} x {layer.dtype}",
            )
        return head, head
    whole = p.units * p.unit_bytes
    if p.units > 1 and p.unit_stride != p.unit_bytes:
        raise ManifestError(f"{field}.unit_stride", "an NHD part must be one contiguous run")
    if whole % kbs or (whole // kbs) % head:
        raise ManifestError(
            f"{field}.unit_bytes", f"{whole} bytes are not {kbs} token rows of whole heads"
        )
    return whole // kbs, whole // kbs


def token_pieces(local: Manifest, remote: Manifest, pairs: list[LayerPair]) -> TokenPieces:
    """What this local rank reads of attention layer ``pairs`` from this remote rank, per token.

    All pairs link one local group to one remote group. HND: one piece per TP unit the remote
    rank serves (rank-relative positions on each side, as :func:`~.pieces.pair_pieces`). NHD:
    the whole part, which must be read whole on both sides (else IncompatiblePeerError naming
    ``<part>.sliceable``); NHD parts with packed K|V rows are refused (``<part>.head_layout``).
    """
    ltp, rtp = (local.tp_size, local.tp_rank), (remote.tp_size, remote.tp_rank)
    rows: list[tuple[int, ...]] = []
    bad: dict[str, tuple[object, object]] = {}
    why: dict[str, str] = {}
    for g, i, rg, ri in pairs:
        ll, rl = local.groups[g].layers[i], remote.groups[rg].layers[ri]
        lkbs, rkbs = local.groups[g].kernel_block_size, remote.groups[rg].kernel_block_size
        assert isinstance(ll, AttentionLayer) and isinstance(rl, AttentionLayer)
        for (name, lp), (_n, rp) in zip(layer_parts(ll), layer_parts(rl), strict=True):
            field = part_field(g, i, name)
            if max(lp.rows, rp.rows) > 1 and "NHD" in (ll.head_layout, rl.head_layout):
                sizes = (local.groups[g].block_size, remote.groups[rg].block_size)
                bad[f"{field}.head_layout"] = (ll.head_layout, rl.head_layout)
                why[f"{field}.head_layout"] = (
                    f"re-blocking (block_size {sizes[0]} vs {sizes[1]}) supports packed K|V rows "
                    "only in the HND head layout"
                )
                continue
            lidx, ridx, unsliceable = read_units(lp, rp, ltp, rtp)
            whole = lidx.size == lp.units and ridx.size == rp.units
            if unsliceable or (ll.head_layout == "NHD" and lidx.size and not whole):
                bad[f"{field}.sliceable"] = (lp.sliceable, rp.sliceable)
                continue
            if not lidx.size:
                continue
            lrow, lstep = _row_bytes(ll, lp, lkbs, field)
            rrow, rstep = _row_bytes(rl, rp, rkbs, f"remote.{part_field(rg, ri, name)}")
            if lrow != rrow:
                raise IncompatiblePeerError({f"{field}.units": (lp.units, rp.units)})
            if ll.head_layout == "NHD":
                rows.append(
                    (ll.region, lp.offset, lp.block_stride, rl.region, rp.offset, rp.block_stride,
                     lrow, lstep, rstep)
                )  # fmt: skip
                continue
            for a, b in zip(lidx.tolist(), ridx.tolist(), strict=True):
                rows.append(
                    (ll.region, lp.offset + a * lp.unit_stride, lp.block_stride,
                     rl.region, rp.offset + b * rp.unit_stride, rp.block_stride, lrow, lstep,
                     rstep)
                )  # fmt: skip
    if bad:
        raise IncompatiblePeerError(bad, why)
    t = np.asarray(rows, dtype=np.int64).reshape(-1, 9).T
    return TokenPieces(*(np.ascontiguousarray(c) for c in t))


@dataclass(frozen=True)
class _Side:
    """One side's block geometry of one group."""

    block_size: int
    kernel_block_size: int
    ratio: int


@dataclass(frozen=True, eq=False)
class _Link:
    """The layers of local group ``local`` that live in remote group ``remote``, as pieces."""

    local: int
    remote: int
    tokens: TokenPieces | None
    """Attention: per-token pieces."""
    state: Pieces | None
    """Mamba: per-block pieces of the state block."""


@dataclass(frozen=True, eq=False)
class ReblockGeometry:
    """All of a re-blocking read from one remote rank that does not depend on the request.

    Built once per peer (by :func:`~kvxferd.descriptors.read_geometry` when block ids cannot
    pair up); :meth:`plan` maps each request's token range with numpy only.
    """

    local_blocks: int
    remote_blocks: int
    local: tuple[_Side, ...]
    remote: tuple[_Side, ...]
    windows: tuple[int | None, ...]
    links: tuple[_Link, ...]
    block_diff: dict[str, tuple[object, object]]

    def plan(
        self,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        num_tokens: int,
        remote_tokens: int,
        *,
        coalesce: bool = True,
    ) -> ReadPlan:
        """Descriptor pairs moving tokens ``[0, num_tokens)`` (the window of sliding groups).

        ``local_ids``/``remote_ids`` are each side's logical block ids per group (-1: none);
        ``remote_tokens`` is the prefill's token count (the ticket's). ``num_tokens`` -1 means
        all of them; fewer are allowed for attention-only models (Mamba state covers all the
        prefill's tokens, so a hybrid must take them all). Raises BlockIdError naming the field.
        """
        n = remote_tokens if num_tokens == -1 else num_tokens
        if not 0 <= n <= remote_tokens:
            raise BlockIdError("num_tokens", f"{num_tokens} outside 0..{remote_tokens} (or -1)")
        lids = _check_lists(self.local_blocks, len(self.local), local_ids, "block_ids")
        rids = _check_lists(self.remote_blocks, len(self.remote), remote_ids, "remote_block_ids")
        cols: list[list[np.ndarray]] = [[] for _ in range(5)]
        kv_bytes = state_bytes = 0
        for link in self.links:
            g, rg = link.local, link.remote
            if link.tokens is not None:
                part = _attention(self, link, link.tokens, lids[g], rids[rg], n, remote_tokens)
                kv_bytes += int(part[4].sum()) if part else 0
            else:
                assert link.state is not None
                part = _state(link.state, link, lids[g], rids[rg], n, remote_tokens)
                state_bytes += int(part[4].sum()) if part else 0
            if part:
                for c, a in zip(cols, part, strict=True):
                    c.append(a)
        if not cols[0]:
            return ReadPlan.empty()
        lreg, loff, rreg, roff, ln = (np.concatenate(c) for c in cols)
        plan = ReadPlan(lreg, loff, rreg, roff, ln, kv_bytes, state_bytes)
        return coalesce_plan(plan) if coalesce else plan


def reblock_geometry(local: Manifest, remote: Manifest) -> ReblockGeometry:
    """Precompute token and state pieces for a pair of compared manifests (see read_geometry)."""
    paired = layer_pairs(local, remote)
    if paired is None:
        raise IncompatiblePeerError({"groups": (len(local.groups), len(remote.groups))})
    by_link: dict[tuple[int, int], list[LayerPair]] = {}
    for pair in paired[0]:
        by_link.setdefault((pair[0], pair[2]), []).append(pair)
    links = []
    for (g, rg), pairs in sorted(by_link.items()):
        if family(local.groups[g]) == "attention":
            links.append(_Link(g, rg, token_pieces(local, remote, pairs), None))
        else:
            links.append(_Link(g, rg, None, layer_pieces(local, remote, pairs)))

    def sides(m: Manifest, prefix: str) -> tuple[_Side, ...]:
        return tuple(
            _Side(gr.block_size, gr.kernel_block_size, kernel_ratio(gr, f"{prefix}groups[{g}]"))
            for g, gr in enumerate(m.groups)
        )

    return ReblockGeometry(
        local_blocks=local.num_blocks,
        remote_blocks=remote.num_blocks,
        local=sides(local, ""),
        remote=sides(remote, "remote."),
        windows=tuple(
            gr.sliding_window if gr.kind == "sliding_window" else None for gr in local.groups
        ),
        links=tuple(links),
        block_diff=reblock_fields(local, remote),
    )


# ------------------------------------------------------------------------------------------------


def _check_lists(
    num_blocks: int, num_groups: int, ids_per_group: Sequence[Sequence[int]], field: str
) -> list[np.ndarray]:
    """One id array per group: integers in ``[-1, num_blocks)``, no id twice in a group."""
    seq = list(ids_per_group)
    if len(seq) != num_groups:
        raise BlockIdError(field, f"{len(seq)} id lists for {num_groups} groups (one per group)")
    out = []
    for g, ids in enumerate(seq):
        arr = np.asarray(ids)
        if arr.size == 0:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise BlockIdError(f"{field}[{g}]", "expected a flat list of integer ids")
        arr = arr.astype(np.int64, copy=False)
        bad = np.flatnonzero((arr < -1) | (arr >= num_blocks))
        if bad.size:
            k = int(bad[0])
            raise BlockIdError(
                f"{field}[{g}][{k}]", f"id {int(arr[k])} outside -1..{num_blocks - 1}"
            )
        used = np.flatnonzero(arr >= 0)
        _vals, first, counts = np.unique(arr[used], return_index=True, return_counts=True)
        if (counts > 1).any():
            dup = np.setdiff1d(np.arange(used.size), first)[0]
            k = int(used[dup])
            raise BlockIdError(f"{field}[{g}][{k}]", f"id {int(arr[k])} repeats in the group")
        out.append(arr)
    return out


def _segments(start: int, stop: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """``[start, stop)`` cut at every multiple of ``a`` and of ``b``: (segment starts, lengths)."""
    cuts = np.union1d(
        np.arange(-(-start // a) * a, stop, a, dtype=np.int64),
        np.arange(-(-start // b) * b, stop, b, dtype=np.int64),
    )
    bounds = np.union1d(cuts, np.asarray([start, stop], dtype=np.int64))
    return bounds[:-1], np.diff(bounds)


def _first_block(ids: np.ndarray, tokens: int, block_size: int) -> int:
    """Request block index of ``ids[0]``: a short list ends at the block of the last token."""
    return max(0, -(-tokens // block_size) - ids.size)


def token_blocks(ids: Sequence[int], tokens: int, block_size: int, t: np.ndarray) -> np.ndarray:
    """The logical block id holding each token ``t`` of a ``tokens``-token request whose group
    lists ``ids`` (module rule: a short list ends at the last token's block); -1 for none."""
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    pos = t // block_size - _first_block(arr, tokens, block_size)
    ok = (pos >= 0) & (pos < arr.size)
    if arr.size == 0:
        return np.full(t.shape, -1, dtype=np.int64)
    return np.where(ok, arr.take(pos, mode="clip"), -1)  # np.clip: 10x the cost of take


def _locate(
    ids: np.ndarray, tokens: int, side: _Side, start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(list position, block unit, token row) of each segment start; position -1 if unlisted."""
    blk = start // side.block_size
    pos = blk - _first_block(ids, tokens, side.block_size)
    pos = np.where((pos >= 0) & (pos < ids.size), pos, -1)
    within = start % side.block_size
    ids_at = np.where(pos >= 0, ids[np.maximum(pos, 0)] if ids.size else -1, -1)
    unit = ids_at * side.ratio + within // side.kernel_block_size
    return pos, unit, within % side.kernel_block_size


def _attention(
    geo: ReblockGeometry,
    link: _Link,
    tp: TokenPieces,
    lids: np.ndarray,
    rids: np.ndarray,
    n: int,
    remote_tokens: int,
) -> tuple[np.ndarray, ...] | None:
    g, rg = link.local, link.remote
    window = geo.windows[g]
    start = max(0, n - window) if window else 0
    if start >= n or tp.row.size == 0:
        return None
    ls, rs = geo.local[g], geo.remote[rg]
    seg, length = _segments(start, n, ls.kernel_block_size, rs.kernel_block_size)
    lpos, lunit, ltau = _locate(lids, n, ls, seg)
    if (lpos < 0).any():
        t = int(seg[np.argmax(lpos < 0)])
        raise BlockIdError(f"block_ids[{g}]", f"no local block listed for token {t} of {n}")
    keep = lids[lpos] >= 0
    seg, length, lunit, ltau = seg[keep], length[keep], lunit[keep], ltau[keep]
    if seg.size == 0:
        return None
    rpos, runit, rtau = _locate(rids, remote_tokens, rs, seg)
    missing = (rpos < 0) | (rids[np.maximum(rpos, 0)] < 0 if rids.size else True)
    if np.any(missing):
        k = int(np.argmax(missing))
        where = f"remote_block_ids[{rg}]" + (f"[{int(rpos[k])}]" if rpos[k] >= 0 else "")
        raise BlockIdError(where, f"token {int(seg[k])} is to be moved but has no remote block")
    whole = (tp.local_step == tp.row) & (tp.remote_step == tp.row)
    out = [_emit(tp, whole, lunit, ltau, runit, rtau, length)]
    if not whole.all():  # rows not contiguous on a side: one descriptor per token
        within = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(length) - length, length
        )
        lu, ru = np.repeat(lunit, length), np.repeat(runit, length)
        lt, rt = np.repeat(ltau, length) + within, np.repeat(rtau, length) + within
        out.append(_emit(tp, ~whole, lu, lt, ru, rt, np.ones_like(lu)))
    return tuple(np.concatenate(c) for c in zip(*out, strict=True))


def _emit(
    tp: TokenPieces,
    sel: np.ndarray,
    lunit: np.ndarray,
    ltau: np.ndarray,
    runit: np.ndarray,
    rtau: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, ...]:
    """Descriptor columns of pieces ``sel`` for every segment (``length`` tokens from row tau)."""
    row = tp.row[sel][:, None]
    loff = (tp.local_offset[sel][:, None] + tp.local_stride[sel][:, None] * lunit
            + tp.local_step[sel][:, None] * ltau)  # fmt: skip
    roff = (tp.remote_offset[sel][:, None] + tp.remote_stride[sel][:, None] * runit
            + tp.remote_step[sel][:, None] * rtau)  # fmt: skip
    m = lunit.size
    return (
        np.repeat(tp.local_region[sel], m),
        loff.ravel(),
        np.repeat(tp.remote_region[sel], m),
        roff.ravel(),
        (row * length).ravel(),
    )


def _state(
    p: Pieces, link: _Link, lids: np.ndarray, rids: np.ndarray, n: int, remote_tokens: int
) -> tuple[np.ndarray, ...] | None:
    """The running state: the last listed local block receives the last listed remote one."""
    lkeep = np.flatnonzero(lids >= 0)
    if lkeep.size == 0 or p.length.size == 0:
        return None
    if n != remote_tokens:
        raise BlockIdError(
            "num_tokens",
            f"{n} tokens asked, but group {link.local}'s state covers the prefill's "
            f"{remote_tokens}",
        )
    rkeep = np.flatnonzero(rids >= 0)
    if rkeep.size == 0:
        raise BlockIdError(f"remote_block_ids[{link.remote}]", "no state block listed")
    lid, rid = int(lids[lkeep[-1]]), int(rids[rkeep[-1]])
    return (
        p.local_region,
        p.local_offset + p.local_stride * lid,
        p.remote_region,
        p.remote_offset + p.remote_stride * rid,
        p.length,
    )
