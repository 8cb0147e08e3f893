"""A decode engine's pull of one request: the same PullRequest on every rank, one call each
(``POST /v1/pulls/run``, answered with the final status) under one deadline, summed into a
:class:`PullOutcome`.

A rank whose pull may still be running when the wait ends (no answer in time, the connection
lost, an unexpected 500) is *unsettled*: its sidecar may still write into the request's
blocks, so the caller must not reuse them. Any other error answer comes from the checks made
before a pull starts: refused, settled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from kvxferd.client import AsyncEngineClient
from kvxferd.errors import KvxferdError
from kvxferd.wire import PullRequest, PullStatus

SETTLE_S = 15.0
"""How long past the pull's own deadline we wait for a rank to report done or failed."""


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
    """Run ``req`` on every rank; wait until all end or ``deadline_s + settle_s`` passes."""
    deadline = time.monotonic() + req.deadline_s + settle_s
    results = await asyncio.gather(*(_run(c, req, deadline) for c in clients))
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


async def _run(
    client: AsyncEngineClient, req: PullRequest, deadline: float
) -> tuple[PullStatus | None, str, bool]:
    """(final status or None, failure text or "", settled) of one rank."""
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            status = await client.run_pull(req)
    except TimeoutError:
        return None, "no final status by its deadline", False
    except (KvxferdError, httpx.HTTPError) as exc:
        code = getattr(exc, "status", None)  # None: no answer; 200: an unusable one
        if isinstance(code, int) and 400 <= code < 600 and code != 500:
            return None, f"pull refused: {_text(exc)}", True  # checked before it started
        return None, f"status unavailable: {_text(exc)}", False
    if status.state == "done":
        return status, "", True
    if status.state == "failed":
        return status, f"{status.reason}: {status.detail}", True
    return status, f"still {status.state} after its deadline", False


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
