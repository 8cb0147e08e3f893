"""What a fault campaign found: faults run and invariant violations, in total and per fault kind.

The report's keys are the contract of ``scripts/fault_campaign.py --json`` (issue 10): the fault
count, one count per invariant and ``by_kind``. Each kind also keeps a few example lines and
free-form notes (phases hit, outcomes seen) that explain its counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

INVARIANTS = (
    "hangs",
    "stale_or_corrupt",
    "writes_after_failed",
    "leaked_holds",
    "leaked_handles",
    "crashes",
    "leftover_shm",
    "secret_leaks",
)
"""Invariant counters, in report order (each must be 0 for the campaign to pass)."""

REPORT_KEYS = ("faults", *INVARIANTS, "by_kind")
_EXAMPLES = 6


class Tally:
    """Counts faults and violations; ``kind`` is the fault kind being run (or ``teardown``)."""

    def __init__(self) -> None:
        self.faults = 0
        self._kinds: dict[str, dict[str, Any]] = {}

    def _kind(self, kind: str) -> dict[str, Any]:
        entry = self._kinds.get(kind)
        if entry is None:
            entry = {"count": 0, **{inv: 0 for inv in INVARIANTS}, "examples": [],
                     "notes": Counter(), "skipped": ""}  # fmt: skip
            self._kinds[kind] = entry
        return entry

    def fault(self, kind: str) -> None:
        """One fault of ``kind`` was run."""
        self.faults += 1
        self._kind(kind)["count"] += 1

    def violate(self, kind: str, invariant: str, what: str, n: int = 1) -> None:
        """``n`` violations of ``invariant`` under ``kind``; ``what`` says which (an example)."""
        if invariant not in INVARIANTS:
            raise ValueError(f"unknown invariant {invariant!r}")
        entry = self._kind(kind)
        entry[invariant] += n
        if len(entry["examples"]) < _EXAMPLES:
            entry["examples"].append(f"{invariant}: {what}")

    def note(self, kind: str, key: str, n: int = 1) -> None:
        """Count an observation that is not a violation (a phase hit, an outcome)."""
        self._kind(kind)["notes"][key] += n

    def skip(self, kind: str, why: str) -> None:
        """Record why ``kind`` could not run here."""
        self._kind(kind)["skipped"] = why

    def total(self, invariant: str) -> int:
        """Violations of ``invariant`` over every kind."""
        return sum(e[invariant] for e in self._kinds.values())

    def violations(self) -> int:
        """Violations of every invariant together."""
        return sum(self.total(inv) for inv in INVARIANTS)

    def report(self) -> dict[str, Any]:
        """The campaign's JSON object (exactly REPORT_KEYS)."""
        by_kind = {}
        for kind, e in sorted(self._kinds.items()):
            by_kind[kind] = {**e, "notes": dict(sorted(e["notes"].items()))}
        return {"faults": self.faults, **{inv: self.total(inv) for inv in INVARIANTS},
                "by_kind": by_kind}  # fmt: skip
