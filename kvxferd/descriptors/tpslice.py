"""Heterogeneous TP: which TP units each rank holds, and which remote rank serves each unit.

Ownership rule, identical on both sides: with ``n = units_total // tp``, rank ``r`` holds units
``[r * n, (r + 1) * n)`` when ``units_total % tp == 0``; when ``tp % units_total == 0`` the units
are replicated and rank ``r`` holds the single unit ``r * units_total // tp``. Anything else has
no sensible split and is a :class:`ManifestError`.

Source choice: a unit replicated on ``h`` remote ranks is read by local rank ``l`` from the
``l % h``-th of them. It is deterministic, each local unit is read exactly once over all remote
ranks, and replicas share the load when local ranks are replicated too.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvxferd.descriptors.geometry import iter_parts, part_field
from kvxferd.errors import ManifestError
from kvxferd.wire import Manifest, Part


def owned_units(units_total: int, tp_size: int, tp_rank: int, field: str = "units") -> range:
    """Global indices of the TP units rank ``tp_rank`` of ``tp_size`` holds."""
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ManifestError("tp_rank", f"rank {tp_rank} outside tp_size {tp_size}")
    if units_total % tp_size == 0:
        n = units_total // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % units_total == 0:
        u = tp_rank * units_total // tp_size
        return range(u, u + 1)
    raise ManifestError(
        field, f"{units_total} TP units cannot be split over tp_size {tp_size} (nor replicated)"
    )


def unit_holders(units_total: int, tp_size: int, unit: int) -> range:
    """The ranks of ``tp_size`` that hold global unit ``unit`` (several when replicated)."""
    if units_total % tp_size == 0:
        r = unit // (units_total // tp_size)
        return range(r, r + 1)
    k = tp_size // units_total
    return range(unit * k, (unit + 1) * k)


@lru_cache(maxsize=4096)
def _sources(units_total: int, local_tp: int, local_rank: int, remote_tp: int) -> tuple:
    owned = owned_units(units_total, local_tp, local_rank)
    owned_units(units_total, remote_tp, 0)  # validates the rule on the remote side
    out = []
    for u in owned:
        holders = unit_holders(units_total, remote_tp, u)
        out.append(holders[local_rank % len(holders)])
    return tuple(out)


def unit_sources(units_total: int, local_tp: int, local_rank: int, remote_tp: int) -> np.ndarray:
    """For each unit the local rank holds (in order), the remote rank it is read from."""
    return np.asarray(_sources(units_total, local_tp, local_rank, remote_tp), dtype=np.int64)


def check_units(manifest: Manifest) -> None:
    """Every part's ``units`` must match the ownership rule for this rank (else ManifestError)."""
    for g, i, name, _layer, p in iter_parts(manifest):
        field = f"{part_field(g, i, name)}.units"
        want = len(owned_units(p.units_total, manifest.tp_size, manifest.tp_rank, field))
        if p.units != want:
            raise ManifestError(
                field,
                f"{p.units} units, but rank {manifest.tp_rank}/{manifest.tp_size} holds {want} "
                f"of {p.units_total}",
            )


@lru_cache(maxsize=4096)
def _read_units(
    units_total: int, lsize: int, lrank: int, rsize: int, rrank: int
) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    lown = owned_units(units_total, lsize, lrank)
    rown = owned_units(units_total, rsize, rrank)
    src = unit_sources(units_total, lsize, lrank, rsize)
    glob = np.arange(lown.start, lown.stop, dtype=np.int64)[src == rrank]
    local_sliced = bool((src != src[0]).any())
    remote_sliced = 0 < glob.size != len(rown)
    lidx, ridx = glob - lown.start, glob - rown.start
    lidx.flags.writeable = False
    ridx.flags.writeable = False
    return lidx, ridx, local_sliced, remote_sliced


def read_units(
    local: Part, remote: Part, local_tp: tuple[int, int], remote_tp: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Unit indices (local, remote; rank-relative) that ``local`` reads from this remote rank.

    ``local_tp`` and ``remote_tp`` are ``(tp_size, tp_rank)``. The arrays are empty when the
    remote rank serves none of this part's units to this local rank. The flag says whether the
    read needs a slice of a part that is not ``sliceable`` on its side: the local part is sliced
    when its units come from several remote ranks, the remote part when only some of its units
    are read.
    """
    lidx, ridx, local_sliced, remote_sliced = _read_units(local.units_total, *local_tp, *remote_tp)
    bad = (local_sliced and not local.sliceable) or (remote_sliced and not remote.sliceable)
    return lidx, ridx, bad


def unit_totals(manifest: Manifest) -> tuple[int, ...]:
    """The distinct ``units_total`` of a manifest's parts (all that rank ownership depends on)."""
    return tuple(sorted({p.units_total for *_x, p in iter_parts(manifest)}))


@lru_cache(maxsize=4096)
def ranks_read(totals: tuple[int, ...], local_tp: int, local_rank: int, remote_tp: int) -> tuple:
    """The remote ranks a local rank reads from, given its parts' distinct unit totals."""
    ranks: set[int] = set()
    for ut in totals:
        ranks.update(_sources(ut, local_tp, local_rank, remote_tp))
    return tuple(sorted(ranks))


def source_ranks(local: Manifest, remote_tp: int) -> list[int]:
    """The remote ranks (of a peer with ``remote_tp`` ranks) this local rank reads from.

    Request independent: a request that leaves some groups empty may read nothing from some of
    them, but the local rank still notifies each one so that its hold count adds up.
    """
    return list(ranks_read(unit_totals(local), local.tp_size, local.tp_rank, remote_tp))


def expected_readers(remote: Manifest, decode_tp: int) -> int:
    """How many ranks of a ``decode_tp`` peer read from the rank that ``remote`` describes.

    The prefill side releases a hold after this many notifications. Zero means no decode rank
    reads from this rank (its units are served by a replica), so the hold can go at once.
    """
    readers = 0
    totals = {p.units_total for *_x, p in iter_parts(remote)}
    for d in range(decode_tp):
        if any(remote.tp_rank in _sources(ut, decode_tp, d, remote.tp_size) for ut in totals):
            readers += 1
    return readers
