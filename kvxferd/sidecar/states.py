"""Forward-only state machines of pulls and holds, as IntEnums whose order is progress.

A state may only move to a strictly later one (skipping is allowed: a cached handshake goes
straight from pending to claiming); terminal states never move again. Progress is the integer
order of the live states and DONE, so "how far did these get" over several ranks' states is their
minimum (SGLang's KVPoll) -- except that FAILED is not progress: :func:`overall` says FAILED as
soon as any rank failed, whatever the others reached.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import TypeVar

from kvxferd.errors import StateError
from kvxferd.wire import PullStateName


class PullState(IntEnum):
    """Decode-side progress of one pull; DONE and FAILED are terminal, FAILED is sticky."""

    PENDING = 0
    HANDSHAKING = 1
    CLAIMING = 2
    TRANSFERRING = 3
    DONE = 4
    FAILED = 5

    @property
    def terminal(self) -> bool:
        """Whether no further move is allowed."""
        return self in (PullState.DONE, PullState.FAILED)

    @property
    def wire_name(self) -> PullStateName:
        """The ``wire.PullStatus.state`` string of this state."""
        return self.name.lower()  # type: ignore[return-value]

    @classmethod
    def from_wire(cls, name: PullStateName) -> PullState:
        """The state named by a ``wire.PullStatus.state`` string."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"state: unknown pull state {name!r}") from None


class HoldState(IntEnum):
    """Prefill-side life of one hold; RELEASED is terminal (its reason lives on the hold)."""

    HELD = 0
    CLAIMED = 1
    RELEASED = 2

    @property
    def terminal(self) -> bool:
        """Whether no further move is allowed."""
        return self is HoldState.RELEASED


S = TypeVar("S", PullState, HoldState)


def advance(current: S, new: S) -> S:
    """Return ``new`` if moving there from ``current`` is forward; raise StateError otherwise.

    Staying in the same state is refused too: every call must be progress, so a repeated
    transition (a double release, a second "done") surfaces as an error instead of passing.
    """
    if type(current) is not type(new):
        raise StateError(current, new, "states of different machines")
    if current.terminal:
        raise StateError(current, new, f"{current.name} is terminal")
    if new <= current:
        raise StateError(current, new, "states only move forward")
    return new


def overall(states: Iterable[PullState]) -> PullState:
    """How far a pull made of several parts (ranks) got: FAILED if any part failed, else the
    least advanced part (FAILED's integer value is never read as progress)."""
    states = list(states)
    if not states:
        raise ValueError("overall() of no states")
    if PullState.FAILED in states:
        return PullState.FAILED
    return min(states)
