"""A decode sim's pull of one request: one run-pull call per rank under one deadline. A rank is
settled (its blocks reusable) when it answered a final status or refused the pull before it
started; no answer, a lost connection or an unexpected 500 leave it unsettled."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.client import SidecarError, SidecarUnreachableError, error_for
from kvxferd.sim.pulls import pull_all
from kvxferd.wire import ErrorBody, PullRequest, PullStatus

REQ = PullRequest(tickets=[], block_ids=[[1]], num_tokens=16, deadline_s=0.05)


class Rank:
    """Stands in for one rank's AsyncEngineClient: answers ``run_pull`` with ``outcome``."""

    def __init__(self, outcome: PullStatus | BaseException | None) -> None:
        self.outcome = outcome
        self.calls: list[PullRequest] = []

    async def run_pull(self, req: PullRequest) -> PullStatus:
        self.calls.append(req)
        if self.outcome is None:
            await asyncio.Event().wait()  # never answers: the deadline must end the wait
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        assert self.outcome is not None
        return self.outcome


def _done(kv: int) -> PullStatus:
    return PullStatus(pull_id="p", state="done", kv_bytes=kv, duration_s=0.01 * kv)


def _run(*ranks: Rank):
    return asyncio.run(pull_all(ranks, REQ, settle_s=0.05))  # type: ignore[arg-type]


def test_every_rank_done_is_ok_and_settled_with_the_bytes_summed():
    ranks = (Rank(_done(3)), Rank(_done(5)))
    out = _run(*ranks)
    assert (out.ok, out.settled, out.kv_bytes, out.reason) == (True, True, 8, "")
    assert out.seconds == pytest.approx(0.05)
    assert all(r.calls == [REQ] for r in ranks)  # one call per rank


def test_a_failed_rank_is_settled_and_named():
    failed = PullStatus(pull_id="p", state="failed", reason="claim", detail="410 expired")
    out = _run(Rank(_done(1)), Rank(failed))
    assert (out.ok, out.settled) == (False, True)
    assert out.reason == "rank 1: claim: 410 expired"


@pytest.mark.parametrize(
    "exc",
    [
        error_for(422, ErrorBody(error="BlockIdError", detail="block_ids[0][0]: x",
                                 field="block_ids[0][0]")),
        error_for(401, ErrorBody(error="AuthError", detail="tickets[0].token: wrong MAC")),
        error_for(503, ErrorBody(error="NotRegisteredError", detail="no engine")),
    ],
    ids=["422", "401", "503"],
)  # fmt: skip
def test_a_pull_refused_before_it_started_is_settled(exc):
    out = _run(Rank(exc))
    assert (out.ok, out.settled) == (False, True)
    assert out.reason.startswith("rank 0: pull refused: ")


@pytest.mark.parametrize(
    "exc",
    [
        SidecarUnreachableError("POST /v1/pulls/run: ReadError"),
        SidecarError(500, ErrorBody(error="InternalError", detail="boom")),
        SidecarError(200, ErrorBody(error="DecodeError", detail="unusable PullStatus")),
    ],
    ids=["no-answer", "500", "unusable-200"],
)
def test_a_pull_that_may_still_run_is_unsettled(exc):
    out = _run(Rank(_done(1)), Rank(exc))
    assert (out.ok, out.settled) == (False, False)
    assert out.reason.startswith("rank 1: status unavailable: ")


def test_a_rank_that_never_answers_is_cut_at_the_deadline_and_unsettled():
    out = _run(Rank(None))
    assert (out.ok, out.settled) == (False, False)
    assert out.reason == "rank 0: no final status by its deadline"


def test_other_exceptions_are_not_swallowed():
    with pytest.raises(RuntimeError, match="bug"):  # a bug surfaces, never reads as a failure
        _run(Rank(RuntimeError("bug")))
