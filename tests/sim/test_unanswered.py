"""Aborts of holds that got no answer are retried until the sidecar answers: "never placed"
frees the rank's blocks at once, "given up" leaves them to the released feed, and a sidecar
silent past the bound has them freed all the same (counted), so nothing leaks for ever. The
sidecar is a stand-in: this is the sim's bookkeeping."""

from __future__ import annotations

import asyncio

from kvxferd.calls import SidecarUnreachableError
from kvxferd.errors import UnknownHoldError
from kvxferd.sim.unanswered import UnansweredHolds

BOUND_S = 600.0


class _Sidecar:
    """Answers each abort with ``answer``: None (given up), or an exception it raises."""

    def __init__(self, answer: Exception | None) -> None:
        self.answer = answer
        self.aborts = 0

    async def abort(self, hold_id: str) -> None:
        self.aborts += 1
        if self.answer is not None:
            raise self.answer


def _silent() -> Exception:
    return SidecarUnreachableError("DELETE /v1/holds/h: timed out")


def _run(sidecar: _Sidecar, steps) -> tuple[UnansweredHolds, list[tuple[str, int]]]:  # noqa: ANN001
    """Track one hold of request ``r`` on rank 0, then run ``steps(holds, now)`` beside the
    retry loop; the holds and what was settled."""
    settled: list[tuple[str, int]] = []
    now = [0.0]
    holds = UnansweredHolds([sidecar], lambda r, k: settled.append((r, k)), retry_s=0.0,  # type: ignore[list-item]
                            bound_s=BOUND_S, clock=lambda: now[0])  # fmt: skip

    async def scenario() -> None:
        task = asyncio.create_task(holds.run())
        holds.add("r", 0, "h")
        try:
            await asyncio.wait_for(steps(holds, now), 30)
        finally:
            task.cancel()

    asyncio.run(scenario())
    return holds, settled


async def _until(predicate) -> None:  # noqa: ANN001
    while not predicate():
        await asyncio.sleep(0)


def test_a_hold_its_sidecar_never_placed_frees_its_rank_once_an_abort_is_answered():
    sidecar = _Sidecar(_silent())

    async def steps(holds: UnansweredHolds, now: list[float]) -> None:
        await _until(lambda: sidecar.aborts >= 3)
        assert len(holds) == 1  # silent: kept, asked again
        sidecar.answer = UnknownHoldError("no such hold")
        await _until(lambda: len(holds) == 0)

    holds, settled = _run(sidecar, steps)
    assert settled == [("r", 0)] and holds.abandoned == 0


def test_a_hold_the_sidecar_gives_up_is_left_to_the_released_feed():
    async def steps(holds: UnansweredHolds, now: list[float]) -> None:
        await _until(lambda: len(holds) == 0)

    holds, settled = _run(_Sidecar(None), steps)
    assert settled == [] and holds.abandoned == 0


def test_a_sidecar_silent_past_the_bound_has_the_blocks_freed_and_counted():
    sidecar = _Sidecar(_silent())

    async def steps(holds: UnansweredHolds, now: list[float]) -> None:
        await _until(lambda: sidecar.aborts >= 2)
        assert len(holds) == 1
        now[0] = BOUND_S
        await _until(lambda: len(holds) == 0)

    holds, settled = _run(sidecar, steps)
    assert settled == [("r", 0)] and holds.abandoned == 1
