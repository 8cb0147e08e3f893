"""A decode engine's pull of one request: the same PullRequest on every rank, waited for with
one deadline, summed into a :class:`PullOutcome`.

A rank whose pull is still running when the wait ends is *unsettled*: its sidecar may still
write into the request's blocks, so the caller must not reuse them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvxferd.client import AsyncEngineClient
from kvxferd.errors import KvxferdError
from kvxferd.wire import PullAccepted, PullRequest, PullStatus

SETTLE_S = 15.0
"""How long past the pull's own deadline we wait for a rank to report done or failed."""
_POLL_S = 10.0


@dataclass(frozen=True)
class PullOutcome:
    """What the pull of one request did over all ranks."""

    ok: bool
    """Every rank's pull finished ``done``."""
    settled: bool
    """Every rank's pull ended (done, failed or never started): the blocks are ours again."""
    kv_bytes: int = 0
    state_bytes: int = 0
    seconds: float = 0.0
    """Wall time of the slowest rank's pull."""
    reason: str = ""
    """Why it failed: ``rank R: <reason>: <detail>`` of the first failing rank."""


async def pull_all(
    clients: Sequence[AsyncEngineClient], req: PullRequest, settle_s: float = SETTLE_S
) -> PullOutcome:
    """Start ``req`` on every rank and wait until all end or ``deadline_s + settle_s`` passes."""
    deadline = time.monotonic() + req.deadline_s + settle_s
    accepted = await asyncio.gather(*(c.pull(req) for c in clients), return_exceptions=True)
    results = await asyncio.gather(
        *(_wait(c, a, deadline) for c, a in zip(clients, accepted, strict=True))
    )
    reasons = [f"rank {r}: {why}" for r, (_st, why, _s) in enumerate(results) if why]
    statuses = [st for st, _why, _s in results if st is not None]
    return PullOutcome(
        ok=not reasons,
        settled=all(settled for _st, _why, settled in results),
        kv_bytes=sum(st.kv_bytes for st in statuses),
        state_bytes=sum(st.state_bytes for st in statuses),
        seconds=max((st.duration_s for st in statuses), default=0.0),
        reason=reasons[0] if reasons else "",
    )


async def _wait(
    client: AsyncEngineClient, accepted: PullAccepted | BaseException, deadline: float
) -> tuple[PullStatus | None, str, bool]:
    """(final status or None, failure text or "", settled) of one rank."""
    if isinstance(accepted, BaseException):
        if not isinstance(accepted, KvxferdError | httpx.HTTPError):
            raise accepted
        return None, f"pull refused: {_text(accepted)}", True
    while True:
        left = deadline - time.monotonic()
        try:
            status = await client.pull_status(accepted.pull_id, wait_s=max(0.0, min(left, _POLL_S)))
        except (KvxferdError, httpx.HTTPError) as exc:
            return None, f"status unavailable: {_text(exc)}", False
        if status.state == "done":
            return status, "", True
        if status.state == "failed":
            return status, f"{status.reason}: {status.detail}", True
        if left <= 0:
            return status, f"still {status.state} after its deadline", False


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
