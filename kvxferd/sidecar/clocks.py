"""Other clocks read on the sidecar's: an engine call's ``not_after_ns`` and a ticket's wall time.

Engine calls the engine has already given up: an engine's client gives a call up once it times out,
and may then free or reuse the blocks the call names. A sidecar that stalled (stopped, its event
loop blocked) can still read that call from its socket later. Acted on then, a hold would pin
reused blocks for a decode to read, a pull or a store load would write blocks vLLM is recomputing,
and a save would store other KV under this prompt's keys. So such calls carry the time past which
they must not act, on the engine's CLOCK_MONOTONIC: every process of one host shares it, and the
engine socket is local. The sidecar checks it before acting and ends what the call sets going by
then.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvxferd.errors import CallExpiredError


def act_by(
    not_after_ns: int, expired: Callable[[], object] | None = None, now: float | None = None
) -> float:
    """The ``time.monotonic()`` by which a call stamped ``not_after_ns`` must have stopped
    touching the engine's memory (inf for 0); once it has passed, ``expired()`` (a metric's
    ``inc``) and CallExpiredError."""
    if not not_after_ns:
        return math.inf
    now = time.monotonic() if now is None else now
    end = not_after_ns / 1e9
    if now >= end:
        if expired is not None:
            expired()
        raise CallExpiredError(
            f"came {now - end:.3f} s after the engine gave it up (not_after_ns {not_after_ns}): "
            "nothing was done"
        )
    return end


def wall_time(mono: float) -> float:
    """Unix time of a ``time.monotonic()`` time: a ticket's or grant's ``expires_at`` on the
    wire (each side has its own monotonic clock; wall time means the same on both)."""
    return time.time() + (mono - time.monotonic())
