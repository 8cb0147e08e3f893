"""Which saved entries serve which TP units of a reading rank.

An entry written by rank ``r`` of a TP-``W`` engine holds the global units the ownership rule
gives that rank (:func:`kvxferd.descriptors.owned_units`). A reader at any TP size needs its own
units of every part; a :class:`Plan` names, per (units_total, global unit), the entry to take it
from, so a TP-1 reader combines the entries of both TP-2 writers and a TP-2 reader takes its half
of a TP-1 writer's entry. Writers whose TP size cannot split a part's units serve none of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvxferd.descriptors import owned_units
from kvxferd.errors import ManifestError
from kvxferd.store.canonical import PartSpec
from kvxferd.store.format import Section
from kvxferd.store.tiers import EntryId


@dataclass
class Plan:
    """The entry serving each (units_total, global unit) this rank needs (one key and group)."""

    source: dict[tuple[int, int], EntryId] = field(default_factory=dict)

    @property
    def entries(self) -> list[EntryId]:
        """The entries the plan reads, each once, in a stable order."""
        return list(dict.fromkeys(self.source.values()))

    def units_from(self, specs: Iterable[PartSpec]) -> Counter[EntryId]:
        """Per entry, how many units of ``specs`` the plan takes from it (what a load checks
        each entry supplies in full)."""
        return Counter(self.source.get((p.units_total, u)) for p in specs for u in p.owned)


def plan_sources(found: Iterable[EntryId], specs: list[PartSpec]) -> Plan | None:
    """A plan over the entries ``found`` (preferred in the given order), or None when some
    unit this rank needs is in none of them."""
    candidates = list(dict.fromkeys(found))
    if not candidates:
        return None
    plan = Plan()
    for total, owned in {(p.units_total, p.owned) for p in specs}:
        for u in owned:
            src = next((e for e in candidates if u in _owned(total, e)), None)
            if src is None:
                return None
            plan.source[(total, u)] = src
    return plan


def unit_runs(plan: Plan, eid: EntryId, spec: PartSpec, sec: Section) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of global units that section ``sec`` of entry ``eid`` supplies to
    this rank's part ``spec`` under the plan."""
    runs: list[tuple[int, int]] = []
    for u in range(max(sec.unit_start, spec.owned.start),
                   min(sec.unit_start + sec.units, spec.owned.stop)):  # fmt: skip
        if plan.source.get((spec.units_total, u)) != eid:
            continue
        if runs and runs[-1][1] == u:
            runs[-1] = (runs[-1][0], u + 1)
        else:
            runs.append((u, u + 1))
    return runs


def _owned(total: int, eid: EntryId) -> range:
    try:
        return owned_units(total, eid.tp_size, eid.tp_rank)
    except ManifestError:
        return range(0)
