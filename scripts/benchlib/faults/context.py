"""What every fault gets: the targets, the tally, the random source and the campaign's knobs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .listener import ForgedPeer
from .pair import Pair
from .rest import Rest
from .tally import Tally


@dataclass
class Ctx:
    """Shared state of one campaign run."""

    rng: random.Random
    tally: Tally
    pair: Pair
    rest: Rest
    listener: ForgedPeer
    secret: str
    quick: bool = False
    sims: object | None = None
    """The sim-level target (benchlib.faults.sims.Sims) when the campaign runs it."""
    pull_s: float = 0.2
    """Running estimate of a mid-sized pull's duration (to pick kill/stop times)."""
    done_tickets: list = field(default_factory=list)
    """Tickets of pulls that ended DONE (replay material), newest last, bounded."""

    def learn_pull_s(self, seconds: float) -> None:
        self.pull_s = 0.8 * self.pull_s + 0.2 * max(0.02, seconds)
