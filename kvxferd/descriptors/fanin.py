"""One pull's plans for every prefill rank it reads from, computed together.

A decode rank that reads from prefill TP k plans k READs of the same block ids; the ranks'
plans differ only in their pieces (which TP units a rank serves, at which offsets). With the
pieces of all ranks stacked behind a rank column, one set of numpy calls and one coalescing
serve all k ranks. Plans of a few hundred descriptors cost numpy's per-call overhead, not
array work: a fragmented 1k-token Jamba pull from prefill TP 8 plans in 4.4 ms rank by rank and
0.68 ms at once (scripts/bench_pull_plan.py). Each rank's plan is exactly what
:func:`~.mapping.plan_pull` gives it alone (tests/descriptors/test_fanin.py). Peers that
re-block (other block sizes) are planned rank by rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvxferd.descriptors.coalesce import merge_runs
from kvxferd.descriptors.geometry import kernel_ids
from kvxferd.descriptors.mapping import ReadGeometry, id_pairs
from kvxferd.descriptors.pieces import Pieces
from kvxferd.descriptors.plan import ReadPlan


@dataclass(frozen=True, eq=False)
class FanInGeometry:
    """The read geometries of the ranks one pull reads from, their pieces stacked per group."""

    geometries: tuple[ReadGeometry, ...]
    rank: tuple[np.ndarray, ...]
    """Per group: the rank (position in ``geometries``) of each stacked piece."""
    pieces: tuple[Pieces, ...]
    """Per group: every rank's pieces, rank after rank."""
    unit_bytes: np.ndarray
    """``[group, rank]``: bytes one kernel block unit of the group moves from the rank."""

    def plan(
        self,
        local_ids: Sequence[Sequence[int]],
        remote_ids: Sequence[Sequence[int]],
        *,
        local_checked: bool = False,
    ) -> tuple[ReadPlan, ...]:
        """Each rank's coalesced plan for one request whose remote ids are the same on every
        rank (as :func:`~.mapping.plan_pull`; BlockIdError names a bad field)."""
        first = self.geometries[0]
        pairs = first.check_pairs(*id_pairs(local_ids, remote_ids), local_checked=local_checked)
        ranks = len(self.geometries)
        cols: list[list[np.ndarray]] = [[] for _ in range(6)]
        units = np.zeros(len(pairs), dtype=np.int64)  # kernel block units read, per group
        for g, (a, b) in enumerate(pairs):
            p = self.pieces[g]
            if a.size == 0 or p.length.size == 0:
                continue
            kl, kr = kernel_ids(a, first.ratios[g]), kernel_ids(b, first.ratios[g])
            units[g] = kl.size
            cols[0].append(np.repeat(self.rank[g], kl.size))  # piece by piece, as expand
            for col, part in zip(cols[1:], p.expand(kl, kr), strict=True):
                col.append(part)
        if not cols[0]:
            return (ReadPlan.empty(),) * ranks
        rank, lreg, loff, rreg, roff, ln = (np.concatenate(c) for c in cols)
        # The rank leads the sort and must match to merge: within a rank, the order and the
        # merges are those of coalescing that rank's rows alone.
        (rank, lreg, rreg), loff, roff, ln = merge_runs((rank, lreg, rreg), loff, roff, ln)
        bounds = np.searchsorted(rank, np.arange(ranks + 1)).tolist()
        moved = units @ self.unit_bytes  # bytes per rank, [kv, state] split below
        attn = np.asarray(first.is_attention, dtype=bool)
        kv = units[attn] @ self.unit_bytes[attn]  # zeros without attention groups
        plans = []
        for r in range(ranks):
            s = slice(bounds[r], bounds[r + 1])
            kv_r = int(kv[r])
            plans.append(ReadPlan(lreg[s], loff[s], rreg[s], roff[s], ln[s], kv_r,
                                  int(moved[r]) - kv_r))  # fmt: skip
        return tuple(plans)


def fan_in_geometry(geometries: Sequence[ReadGeometry]) -> FanInGeometry | None:
    """The stacked geometry of the ranks one pull reads from, or None where they cannot share
    a plan: a peer that re-blocks, or ranks whose block counts or groups differ."""
    geometries = tuple(geometries)
    if not geometries:
        return None
    first = geometries[0]
    for geo in geometries:
        if geo.reblock is not None:
            return None
        if (geo.local_blocks, geo.remote_blocks, geo.ratios, geo.is_attention) != (
            first.local_blocks, first.remote_blocks, first.ratios, first.is_attention
        ):  # fmt: skip
            return None
    rank, pieces = [], []
    for g in range(len(first.ratios)):
        per = [geo.pieces[g] for geo in geometries]
        rank.append(np.repeat(np.arange(len(per), dtype=np.int64), [p.length.size for p in per]))
        pieces.append(Pieces(*(np.concatenate([getattr(p, f) for p in per]) for f in _FIELDS)))
    unit_bytes = np.asarray(
        [[geo.pieces[g].bytes_per_unit for geo in geometries] for g in range(len(first.ratios))],
        dtype=np.int64,
    ).reshape(len(first.ratios), len(geometries))
    return FanInGeometry(geometries, tuple(rank), tuple(pieces), unit_bytes)


_FIELDS = ("local_region", "local_offset", "local_stride", "remote_region", "remote_offset",
           "remote_stride", "length")  # fmt: skip
