#!/usr/bin/env python3
"""Benchmark the engine API's wires: per-call latency of the hot calls, HTTP/JSON vs HTTP/msgpack
vs frames.

Two ``kvxferd serve`` processes (prefill and decode) on a dense 2-layer model with one 64-wide
KV head, so a one-block pull moves 8 KiB and the call itself dominates. Over each sidecar's Unix
sockets, with one blocking client per wire (``EngineClient(msgpack=False/True)`` over HTTP,
``EngineClient(frames=True)`` over the framed protocol), every iteration times, on all three
back to back (the first rotating), the hot calls of one request: ``POST /v1/holds`` and
``/v1/holds/abort`` (prefill), ``POST /v1/pulls/run`` of a one-block pull (decode),
``GET /v1/pulls/finished`` and ``GET /v1/released`` (one new entry each), and ``GET /healthz``
(the floor: no body either way). Reported: p50 per call and wire and the ratios msgpack / JSON
and frames / JSON (below 1: faster than HTTP/JSON), medians over the same machine state. Then,
in process, the codec alone: encode + decode of a PullRequest of 4 prefill tickets at 1, 1,000
and 8,000 blocks per group (bytes on the wire and microseconds).

Every pull must be done and its block's bytes verified (kvxferd.pattern), every feed must show
the new entry; otherwise the run fails instead of printing numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
import uuid
from collections.abc import Callable
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import msgspec  # noqa: E402
from benchlib import report  # noqa: E402
from benchlib.procs import Pool, SidecarProcess, plan  # noqa: E402
from benchlib.tiny import write_tiny_config  # noqa: E402

from kvxferd.client import EngineClient  # noqa: E402
from kvxferd.pattern import verify_token_pattern, write_token_pattern  # noqa: E402
from kvxferd.wire import HoldRequest, PullRequest, Ticket  # noqa: E402

NUM_BLOCKS = 64
TOKENS = 11
CALLS = ("healthz", "hold", "abort", "run_pull", "finished", "released")
ENCODINGS = ("json", "msgpack", "frames")


class BenchError(RuntimeError):
    """The run cannot report numbers (a failed pull, wrong bytes, a missing feed entry)."""


class Side:
    """One wire's clients to both sidecars and its feed cursors."""

    def __init__(self, prefill: SidecarProcess, decode: SidecarProcess, wire: str) -> None:
        kw = {"msgpack": wire != "json", "frames": wire == "frames"}
        self.p = EngineClient(prefill.socket, timeout_s=60.0, **kw)
        self.d = EngineClient(decode.socket, timeout_s=60.0, **kw)
        self.finished_cursor = 0
        self.released_cursor = 0

    def close(self) -> None:
        self.p.close()
        self.d.close()


def timed(samples: list[float], fn: Callable[[], Any]) -> Any:
    """Call ``fn``, add its wall time (ms) to ``samples``, return its result."""
    t0 = time.perf_counter()
    out = fn()
    samples.append((time.perf_counter() - t0) * 1e3)
    return out


def one_request(side: Side, pools: tuple[Pool, Pool], block: int, seed: int,
                samples: dict[str, list[float]]) -> None:  # fmt: skip
    """The hot calls of one request in one encoding: hold+abort, hold+run pull, both feeds."""
    src, dst = pools
    ids = [[block]]
    timed(samples["healthz"], side.p.healthz)
    # A hold given up at once (timed both ways), then the hold a decode reads.
    req = HoldRequest(request_id=f"a-{uuid.uuid4().hex[:12]}", block_ids=ids, num_tokens=TOKENS)
    ticket = timed(samples["hold"], lambda: side.p.hold(req))
    timed(samples["abort"], lambda: side.p.abort(ticket.hold_id))
    write_token_pattern(src.manifest, src.views, ids, TOKENS, seed)
    req = HoldRequest(request_id=f"r-{uuid.uuid4().hex[:12]}", block_ids=ids, num_tokens=TOKENS)
    ticket = side.p.hold(req)
    pull = PullRequest(tickets=[ticket], block_ids=ids, num_tokens=TOKENS, deadline_s=30.0)
    status = timed(samples["run_pull"], lambda: side.d.run_pull(pull))
    if status.state != "done":
        raise BenchError(f"pull {status.pull_id}: {status.state} {status.reason} {status.detail}")
    bad = verify_token_pattern(dst.manifest, dst.views, ids, TOKENS, seed)
    if bad is not None:
        raise BenchError(f"pull {status.pull_id}: wrong bytes: {bad}")
    feed = timed(samples["finished"], lambda: side.d.finished_pulls(side.finished_cursor))
    if status.pull_id not in [f.pull_id for f in feed.pulls]:
        raise BenchError(f"finished feed lacks pull {status.pull_id}")
    side.finished_cursor = feed.cursor
    released = timed(samples["released"], lambda: side.p.released(side.released_cursor))
    side.released_cursor = released.cursor  # the abort's entry (and older notified ones)


def codec_rows(repeat: int = 50) -> list[dict]:
    """In-process encode + decode of a PullRequest (4 tickets, 2 groups) per size and codec."""
    rows = []
    for blocks in (1, 1000, 8000):
        ids = [list(range(blocks)), list(range(blocks))]
        ticket = Ticket(engine_id="e" * 16, epoch=1 << 40, hold_id="h" * 32, request_id="r" * 32,
                        block_ids=ids, num_tokens=blocks * 16, expires_at=time.time(),
                        tp_rank=0, tp_size=1, peer="127.0.0.1:40000", generation=0,
                        token="ab" * 32)  # fmt: skip
        req = PullRequest(tickets=[ticket] * 4, block_ids=ids, num_tokens=blocks * 16,
                          deadline_s=30.0)  # fmt: skip
        row: dict = {"blocks_per_group": blocks}
        for name, mod in (("json", msgspec.json), ("msgpack", msgspec.msgpack)):
            decoder = mod.Decoder(PullRequest)
            raw = mod.encode(req)
            assert decoder.decode(raw) == req
            t = min(timeit.repeat(lambda m=mod, d=decoder, r=req: d.decode(m.encode(r)),
                                  number=max(1, repeat // blocks), repeat=5))  # fmt: skip
            row[f"{name}_bytes"] = len(raw)
            row[f"{name}_us"] = t / max(1, repeat // blocks) * 1e6
        row["ratio"] = row["msgpack_us"] / row["json_us"]
        rows.append(row)
    return rows


def run(args: argparse.Namespace, tmp: str) -> dict:
    """Start both sidecars, measure, return the JSON result."""
    config = write_tiny_config(tmp)
    prefill, decode = SidecarProcess.start_many(tmp, ["prefill", "decode"])
    pools = (Pool(plan(config, NUM_BLOCKS, {})), Pool(plan(config, NUM_BLOCKS, {})))
    sides: dict[str, Side] = {}
    try:
        for proc, pool in zip((prefill, decode), pools, strict=True):
            with proc.client() as c:
                c.register(pool.manifest, pool.specs())
        sides = {e: Side(prefill, decode, e) for e in ENCODINGS}
        samples = {e: {c: [] for c in CALLS} for e in ENCODINGS}
        scratch = {c: [] for c in CALLS}
        for i in range(args.warmup + args.iterations):
            k = i % len(ENCODINGS)
            order = ENCODINGS[k:] + ENCODINGS[:k]
            for j, enc in enumerate(order):
                into = samples[enc] if i >= args.warmup else scratch
                n = len(ENCODINGS) * i + j
                one_request(sides[enc], pools, n % NUM_BLOCKS, seed=n + 1, samples=into)
    finally:
        for side in sides.values():
            side.close()
        for proc in (prefill, decode):
            proc.stop()
        for pool in pools:
            pool.close()
    rows = []
    for call in CALLS:
        p50 = {e: statistics.median(samples[e][call]) for e in ENCODINGS}
        rows.append({"call": call, "json_p50_ms": p50["json"], "msgpack_p50_ms": p50["msgpack"],
                     "frames_p50_ms": p50["frames"], "ratio": p50["msgpack"] / p50["json"],
                     "frames_ratio": p50["frames"] / p50["json"],
                     "n": len(samples["json"][call])})  # fmt: skip
    return {"machine": report.machine(), "iterations": args.iterations, "rows": rows,
            "codec": codec_rows()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print the table; 1 if the run could not report numbers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=300, help="timed requests per encoding")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests per encoding")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        ap.error("--iterations >= 1, --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="kvx-bench-wire-") as tmp:
        try:
            result = run(args, tmp)
        except BenchError as exc:
            print(f"bench_engine_wire: {exc}", file=sys.stderr)
            return 1
    result["machine"]["load_average_end"] = list(os.getloadavg())
    print(f"{'call':<10} {'json p50 ms':>12} {'msgpack p50 ms':>15} {'frames p50 ms':>14} "
          f"{'msgpack/json':>13} {'frames/json':>12}")  # fmt: skip
    for r in result["rows"]:
        print(f"{r['call']:<10} {r['json_p50_ms']:12.3f} {r['msgpack_p50_ms']:15.3f} "
              f"{r['frames_p50_ms']:14.3f} {r['ratio']:13.3f} "
              f"{r['frames_ratio']:12.3f}")  # fmt: skip
    print(f"\n{'PullRequest':<16} {'json B':>9} {'msgpack B':>10} {'json us':>9} "
          f"{'msgpack us':>11} {'msgpack/json':>13}")  # fmt: skip
    for r in result["codec"]:
        print(f"{r['blocks_per_group']:>6} blocks/grp {r['json_bytes']:9d} "
              f"{r['msgpack_bytes']:10d} {r['json_us']:9.1f} {r['msgpack_us']:11.1f} "
              f"{r['ratio']:13.3f}")  # fmt: skip
    m = result["machine"]
    print(f"{args.iterations} iterations; load average {m['load_average_start']} -> "
          f"{m['load_average_end']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
