"""The demo's verdict: verified only when every answer matches and every pull verified."""

from __future__ import annotations

from typing import Any

import pytest

from kvxferd.demo.drive import Outcome
from kvxferd.demo.summary import percentile, render, summarize
from kvxferd.demo.workload import Job

JOBS = [Job(0, False, False, "a", 4), Job(1, True, True, "b", 4)]
REFERENCE = {JOBS[0].key: "x y", JOBS[1].key: "z"}
GOOD_STATS = {"pulls_ok": 2, "pulls_failed": 0, "recomputed": 0, "verified_ok": 2,
              "verified_failed": 0, "kv_bytes": 3_000_000_000, "state_bytes": 1_000_000_000,
              "transfer_seconds": 2.0}  # fmt: skip


def verdict(outcomes: list[Outcome], stats: dict[str, Any] = GOOD_STATS, **kw: Any) -> Any:
    return summarize(outcomes, REFERENCE, [stats], config="m", prefill_tp=1, decode_tp=1,
                     concurrency=1, wall_s=1.0, **kw)  # fmt: skip


def good() -> list[Outcome]:
    return [Outcome(JOBS[0], "x y", None, 0.1), Outcome(JOBS[1], "z", None, 0.3)]


def test_all_matching_and_verified_is_verified() -> None:
    s = verdict(good())
    assert s.verified and s.requests_ok == 2 and s.requests_failed == 0 and s.mismatches == 0
    assert s.transfer_gbps == pytest.approx(2.0)  # (3 + 1) GB in 2 s
    assert s.latency_p50_s == 0.1 and s.latency_p99_s == 0.3
    assert "verified      YES" in render(s)


def test_one_wrong_text_is_not_verified() -> None:
    outcomes = good()
    outcomes[1] = Outcome(JOBS[1], "zz", None, 0.3)
    s = verdict(outcomes)
    assert not s.verified and s.mismatches == 1
    assert "request 1: text differs" in s.failures[0]
    assert "verified      NO" in render(s)


def test_a_failed_request_is_not_verified() -> None:
    s = verdict([good()[0], Outcome(JOBS[1], None, "APIError: 502", 0.3)])
    assert not s.verified and s.requests_failed == 1 and s.failures == ["request 1: APIError: 502"]


@pytest.mark.parametrize("counter", ["verified_failed", "pulls_failed"])
def test_a_failed_pull_or_verification_is_not_verified(counter: str) -> None:
    assert not verdict(good(), {**GOOD_STATS, counter: 1}).verified


def test_nothing_verified_or_stats_unreadable_is_not_verified() -> None:
    assert not verdict(good(), {**GOOD_STATS, "verified_ok": 0}).verified
    s = verdict(good(), other_failures=["decode sim: /v1/stats unreadable"])
    assert not s.verified and s.failures == ["decode sim: /v1/stats unreadable"]


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) == 0.0
