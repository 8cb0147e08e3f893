"""The demo's verdict: answers compared with the colocated reference, the decode sims' transfer
counters, latency percentiles; rendered as a table or one JSON object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvxferd.demo.drive import Outcome

STAT_KEYS = ("pulls_ok", "pulls_failed", "recomputed", "verified_ok", "verified_failed",
             "kv_bytes", "state_bytes", "transfer_seconds")  # fmt: skip
"""Counters summed over the decode sims' ``/v1/stats``."""


@dataclass(frozen=True)
class Summary:
    """Everything ``--json`` prints."""

    config: str
    prefill_tp: int
    decode_tp: int
    concurrency: int
    requests: int
    requests_ok: int
    requests_failed: int
    mismatches: int
    verified: bool
    kv_bytes: int
    state_bytes: int
    transfer_seconds: float
    transfer_gbps: float
    pulls_ok: int
    pulls_failed: int
    recomputed: int
    verified_ok: int
    verified_failed: int
    latency_p50_s: float
    latency_p99_s: float
    wall_s: float
    failures: list[str]
    prompt_tokens: int = 0
    """Prompt tokens of the answered requests (the decode sims' count)."""
    store_hit_tokens: int = 0
    """Prompt tokens the prefill sims loaded from the store (--store) and verified."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(
    outcomes: Sequence[Outcome],
    reference: Mapping[tuple[bool, str, int], str],
    decode_stats: Sequence[Mapping[str, Any]],
    *,
    config: str,
    prefill_tp: int,
    decode_tp: int,
    concurrency: int,
    wall_s: float,
    other_failures: Sequence[str] = (),
    prefill_stats: Sequence[Mapping[str, Any]] = (),
) -> Summary:
    """Verified means: every request answered, every text equals the colocated one, the decodes
    verified at least one pull and none failed verification or pulling, nothing else failed."""
    totals = {k: sum(s.get(k, 0) for s in decode_stats) for k in STAT_KEYS}
    failures = [*other_failures]
    failures += [f"request {o.job.index}: {o.error}" for o in outcomes if not o.ok]
    mismatches = 0
    for o in outcomes:
        if o.ok and o.text != reference.get(o.job.key):
            mismatches += 1
            failures.append(
                f"request {o.job.index}: text differs from colocated: {o.text!r} != "
                f"{reference.get(o.job.key)!r}"
            )
    ok = sum(o.ok for o in outcomes)
    seconds = float(totals["transfer_seconds"])
    moved = int(totals["kv_bytes"]) + int(totals["state_bytes"])
    verified = (
        ok == len(outcomes)
        and mismatches == 0
        and totals["verified_failed"] == 0
        and totals["pulls_failed"] == 0
        and totals["verified_ok"] > 0
        and not other_failures
        and all(s.get("store_verified_failed", 0) == 0 for s in prefill_stats)
    )
    latencies = [o.latency_s for o in outcomes if o.ok]
    return Summary(
        config=config,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        concurrency=concurrency,
        requests=len(outcomes),
        requests_ok=ok,
        requests_failed=len(outcomes) - ok,
        mismatches=mismatches,
        verified=verified,
        kv_bytes=int(totals["kv_bytes"]),
        state_bytes=int(totals["state_bytes"]),
        transfer_seconds=seconds,
        transfer_gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
        pulls_ok=int(totals["pulls_ok"]),
        pulls_failed=int(totals["pulls_failed"]),
        recomputed=int(totals["recomputed"]),
        verified_ok=int(totals["verified_ok"]),
        verified_failed=int(totals["verified_failed"]),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        wall_s=wall_s,
        failures=failures,
        prompt_tokens=int(sum(s.get("prompt_tokens", 0) for s in decode_stats)),
        store_hit_tokens=int(sum(s.get("store_hit_tokens", 0) for s in prefill_stats)),
    )


def render(s: Summary) -> str:
    """The human table."""
    rows = [
        ("model", f"{s.config} (prefill TP {s.prefill_tp} -> decode TP {s.decode_tp})"),
        ("requests", f"{s.requests_ok} ok, {s.requests_failed} failed of {s.requests} "
                     f"(concurrency {s.concurrency})"),
        ("pulls", f"{s.pulls_ok} ok, {s.pulls_failed} failed, {s.recomputed} recomputed"),
        ("bytes moved", f"KV {_size(s.kv_bytes)}, state {_size(s.state_bytes)}"),
        ("transfer", f"{s.transfer_gbps:.2f} GB/s ({_size(s.kv_bytes + s.state_bytes)} in "
                     f"{s.transfer_seconds:.3f} s of pulls)"),
        ("latency e2e", f"p50 {s.latency_p50_s * 1e3:.0f} ms, p99 {s.latency_p99_s * 1e3:.0f} ms"),
        ("verification", f"{s.verified_ok} pulls byte-verified, {s.verified_failed} failed; "
                         f"{s.requests_ok - s.mismatches}/{s.requests} texts equal colocated"),
        ("store", f"{s.store_hit_tokens} of {s.prompt_tokens} prompt tokens loaded from the "
                  "store and verified"),
        ("verified", "YES" if s.verified else "NO"),
        ("wall time", f"{s.wall_s:.1f} s"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  ! {f}" for f in s.failures[:10]]
    if len(s.failures) > 10:
        lines.append(f"  ! ... and {len(s.failures) - 10} more")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
