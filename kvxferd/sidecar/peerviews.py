"""What a pull needs that does not depend on the request, computed once per peer epoch.

Rank ownership (which prefill ranks this decode rank reads from, and which no decode rank reads)
depends only on the local registration and the prefill's TP size; it is kept here keyed by the
registered manifest's identity, so a re-registration starts afresh.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvxferd import descriptors
from kvxferd.sidecar.pull_request import unread_ranks
from kvxferd.wire import Manifest

_KEEP = 64  # (registration, prefill TP) pairs remembered


@dataclass(frozen=True)
class RankPlan:
    """The prefill ranks one pull touches, for one (registration, prefill TP size)."""

    sources: tuple[int, ...]
    """Ranks this rank READs from (and notifies)."""
    unread: tuple[int, ...]
    """Ranks no decode rank reads from, released by this rank (decode rank 0 only)."""


class RankPlans:
    """A bounded cache of :class:`RankPlan` by (registered manifest, prefill TP size)."""

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple[int, int], tuple[Manifest, RankPlan]] = OrderedDict()

    def get(self, local: Manifest, remote_tp: int) -> RankPlan:
        """The plan for this registration and prefill TP (computed on first use)."""
        key = (id(local), remote_tp)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is local:
            self._plans.move_to_end(key)
            return hit[1]
        plan = RankPlan(
            tuple(descriptors.source_ranks(local, remote_tp)),
            tuple(unread_ranks(local, remote_tp)),
        )
        self._plans[key] = (local, plan)
        while len(self._plans) > _KEEP:
            self._plans.popitem(last=False)
        return plan
