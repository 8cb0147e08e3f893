#!/usr/bin/env python3
"""Benchmark the P/D control plane: tiny requests through proxy -> prefill sim -> decode sim.

A prefill sim, a decode sim (each with its ``kvxferd serve`` sidecar) and the proxy run as
children (``kvxferd.demo.Cluster``) on a dense 2-layer model with one 64-wide KV head, so a
request of a few tokens moves 8 KiB and the control plane dominates. At each concurrency the
same prompts are sent three ways (``benchlib.control_load``): through the proxy, as the proxy's
two calls made directly, and to the decode sim alone without ``kv_transfer_params`` (computed
locally, no transfer). Reported: requests/s, p50/p99, the proxy's own overhead (proxy - direct)
and the P/D overhead (proxy - local) against the issue's target of 3 ms at concurrency 1, plus
a concurrency-1 profile of where the time goes (``benchlib.control_profile``).

Every answer must be a 200 with one choice, the three ways must give the same text for each
prompt, and the decode sim must report every pull verified byte for byte; otherwise the run
fails instead of printing numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from benchlib import control_load as load  # noqa: E402
from benchlib import control_probe as probe  # noqa: E402
from benchlib import control_report, report  # noqa: E402
from benchlib.control_profile import cpu_by_mode, profile  # noqa: E402
from benchlib.tiny import TINY_MODEL, write_tiny_config  # noqa: E402

import kvxferd  # noqa: E402
from kvxferd.demo import Cluster, ClusterSpec  # noqa: E402

TARGET_MS = 3.0
"""Issue 6: p50 end-to-end overhead of a tiny request at concurrency 1."""
PROMPTS = tuple(f"request {i} asks the model for one tiny token" for i in range(16))
"""11 tokens each (< one 16-token block, so the decode's prefix cache never skips a pull)."""
FULL = {"requests": 300, "concurrency": "1,8,64", "rounds": 3, "warmup": 16, "profile": 100}
QUICK = {"requests": 24, "concurrency": "1,8", "rounds": 1, "warmup": 4, "profile": 12}
POOL_BLOCKS = 1024
CHECKED = ("pulls_ok", "pulls_failed", "verified_ok", "verified_failed", "prefix_hits",
           "requests_failed", "kv_bytes", "blocks_pulled")  # fmt: skip


class BenchError(RuntimeError):
    """The run cannot report numbers (failed requests, wrong bytes, mismatched answers)."""


def git_state() -> dict:
    """Commit and dirty flag of the tree the sims import (the bench's own kvxferd package)."""
    root = Path(kvxferd.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "kvxferd")
    return {"kvxferd_path": str(root), "commit": git("rev-parse", "HEAD") or None,
            "kvxferd_dirty": bool(dirty)}  # fmt: skip


def our_pids(cluster: Cluster) -> dict[str, list[int]]:
    """Our processes by role: this client, each sim, its sidecars, the proxy."""
    roles = {"client": [os.getpid()]}
    for sim in [*cluster.prefills, *cluster.decodes]:
        roles[f"{sim.role} sim"] = [sim.child.pid]
        roles[f"{sim.role} sidecar"] = probe.child_pids(sim.child.pid)
    if cluster.proxy is not None:
        roles["proxy"] = [cluster.proxy.pid]
    return roles


def level_row(c: int, s: dict[str, load.Samples], cpu: dict) -> dict:
    """The JSON object of one concurrency level."""
    row: dict = {"concurrency": c, "requests": len(s["proxy"].latencies_ms)}
    for mode, prefix in (("proxy", ""), ("direct", "direct_"), ("local", "local_")):
        if not s[mode].latencies_ms:
            raise BenchError(f"concurrency {c}: every {mode} request failed: {s[mode].errors[0]}")
        row[f"{prefix}errors"] = len(s[mode].errors)
        row[f"{prefix}rps"] = s[mode].rps
        row[f"{prefix}p50_ms"] = s[mode].pct(50)
        row[f"{prefix}p99_ms"] = s[mode].pct(99)
    halves = s["direct"].halves_ms
    row["direct_prefill_p50_ms"] = load.Samples("x", [h[0] for h in halves]).pct(50)
    row["direct_decode_p50_ms"] = load.Samples("x", [h[1] for h in halves]).pct(50)
    row["proxy_overhead_p50_ms"] = row["p50_ms"] - row["direct_p50_ms"]
    row["pd_overhead_p50_ms"] = row["p50_ms"] - row["local_p50_ms"]
    row["load_average"] = os.getloadavg()[0]
    row["cpu_cores"] = cpu
    return row


def cpu_per_request(cores: dict, requests: int) -> dict[str, float]:
    """CPU milliseconds our processes spent per request of a level (all three modes, warm-up
    included), each and together: what a request costs whatever else runs on the machine."""
    out = {role: round(s * 1e3 / requests, 2) for role, s in cores["cpu_s"].items()}
    out["ours"] = round(sum(cores["cpu_s"].values()) * 1e3 / requests, 2)
    return out


def check_answers(texts: dict[str, dict[int, str]]) -> None:
    """Every prompt got the same text through the proxy, directly and locally."""
    for i, local in texts["local"].items():
        for mode in ("proxy", "direct"):
            got = texts[mode].get(i)
            if got is not None and got != local:
                raise BenchError(f"prompt {i}: {mode} answered {got!r}, local {local!r}: the "
                                 f"pulled KV differs from the locally computed one")  # fmt: skip


def check_pulls(before: dict, after: dict, pd_requests: int, failed: int) -> dict:
    """Every P/D request pulled and verified its block(s) (``failed`` requests that got an
    error answer may have died before reaching the decode); returns the counter deltas."""
    d = probe.delta(before, after, CHECKED)
    # A request answered with an error may have lost its pull to a dropped connection (counted
    # as a failed pull); a wrong byte is never tolerated.
    bad = {k: d[k] for k in ("verified_failed",) if d[k]}
    if d["pulls_failed"] > failed:
        bad["pulls_failed"] = d["pulls_failed"]
    pulled = pd_requests - failed <= d["pulls_ok"] <= pd_requests
    if bad or not pulled or d["verified_ok"] != d["pulls_ok"]:
        raise BenchError(f"decode sim counters over the run: {d}; expected {pd_requests} pulls "
                         f"({failed} requests failed), all verified, none failed")  # fmt: skip
    if d["prefix_hits"]:
        raise BenchError(f"{d['prefix_hits']} prefix-cache hits: some requests skipped the pull")
    return d


def run(args: argparse.Namespace, levels: list[int], model_dir: str, settings: dict) -> dict:
    """Start the cluster, measure every level and the profile; the JSON result."""
    result: dict = {"machine": report.machine(), "settings": settings, "levels": [],
                    "profile": None}  # fmt: skip
    result["machine"].update(git_state())
    spec = ClusterSpec(config=os.path.join(model_dir, "config.json"), pool_blocks=POOL_BLOCKS,
                       colocated=False, on_pull_failure="fail",
                       log_level="warning")  # fmt: skip
    t0 = time.monotonic()
    with Cluster(spec) as cluster:
        result["startup_s"] = round(time.monotonic() - t0, 1)
        ep = load.Endpoints(cluster.proxy_url, cluster.prefills[0].url, cluster.decodes[0].url)
        wl = load.Workload(cluster.model, PROMPTS, args.max_tokens)
        decode_sc = probe.sidecars(cluster.decodes[0].child.pid)
        prefill_sc = probe.sidecars(cluster.prefills[0].child.pid)
        if not decode_sc:
            print("# decode sidecar /metrics not found via /proc: no per-phase pull times",
                  file=sys.stderr)  # fmt: skip
        cpu = probe.CpuMeter(our_pids(cluster))
        before = probe.stats(ep.decode)
        pd_requests = failed = 0
        texts: dict[str, dict[int, str]] = {m: {} for m in load.MODES}
        for c in levels:
            warm = max(args.warmup, c) if args.warmup else 0  # opens every connection
            cpu.restart()
            samples = asyncio.run(load.level(ep, wl, c, args.requests, args.rounds, warm))
            for m in load.MODES:
                texts[m].update(samples[m].texts)
            pd_requests += 2 * (warm + args.requests)
            row = level_row(c, samples, cpu.read())
            row["cpu_ms_per_request"] = cpu_per_request(
                row["cpu_cores"], len(load.MODES) * (warm + args.requests)
            )
            result["levels"].append(row)
            failed += row["errors"] + row["direct_errors"]
            for m in load.MODES:
                for why in samples[m].errors[:3]:
                    print(f"  ! {m} request failed: {why}", flush=True)
            print(f"  concurrency {c:>3}: {row['rps']:7.1f} req/s  p50 {row['p50_ms']:7.2f} ms  "
                  f"p99 {row['p99_ms']:7.2f} ms  direct {row['direct_p50_ms']:7.2f}  local "
                  f"{row['local_p50_ms']:7.2f}  P/D overhead {row['pd_overhead_p50_ms']:7.2f} ms  "
                  f"CPU {row['cpu_ms_per_request']['ours']:6.2f} ms/request",
                  flush=True)  # fmt: skip
        check_answers(texts)
        cpu.restart()
        prof = asyncio.run(
            profile(
                ep,
                wl,
                args.profile,
                decode_sc[0] if decode_sc else None,
                prefill_sc[0] if prefill_sc else None,
            )  # fmt: skip
        )
        prof["cpu_cores"] = cpu.read()
        pd_requests += 2 * (args.profile + 1)
        prof["cpu_ms_by_mode"] = asyncio.run(cpu_by_mode(ep, wl, 3 * args.profile, cpu))
        pd_requests += 3 * args.profile + 1
        result["profile"] = prof
        counters = check_pulls(before, probe.stats(ep.decode), pd_requests, failed)
        result["decode_counters"] = counters
        result["settings"]["kv_bytes_per_request"] = counters["kv_bytes"] // counters["pulls_ok"]
    return result


def target(result: dict) -> dict:
    """Where the P/D overhead at concurrency 1 stands against the 3 ms target."""
    c1 = next((lv for lv in result["levels"] if lv["concurrency"] == 1), None)
    value = c1["pd_overhead_p50_ms"] if c1 else result["profile"]["derived_ms"]["pd_overhead"]
    return {"pd_overhead_p50_ms": value, "target_ms": TARGET_MS, "met": value <= TARGET_MS,
            "source": "levels[concurrency=1]" if c1 else "profile"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, print the tables; 1 if the run could not report numbers."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 1 minute, CI)")
    ap.add_argument("--requests", type=int, help="timed requests per mode per level (300)")
    ap.add_argument("--concurrency", help="comma list of concurrency levels (1,8,64)")
    ap.add_argument("--rounds", type=int, help="rounds per level, mode order rotating (3)")
    ap.add_argument(
        "--warmup",
        type=int,
        help="untimed requests per mode per level, at least the concurrency (16)",
    )
    ap.add_argument("--profile", type=int, help="sequential requests of the profile (100)")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens to generate (1)")
    ap.add_argument("--label", default="", help="free text recorded in the JSON (which tree)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw latency and req/s vs concurrency")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c})
    except ValueError:
        ap.error(f"--concurrency: not a comma list of integers: {args.concurrency!r}")
    if not levels or min(levels) < 1:
        ap.error("--concurrency: at least one level, each >= 1")
    if args.requests < 1 or args.rounds < 1 or args.warmup < 0 or args.profile < 1:
        ap.error("--requests, --rounds, --profile >= 1; --warmup >= 0")
    if args.rounds > args.requests:
        ap.error("--rounds must not exceed --requests")
    if not 1 <= args.max_tokens <= 4096:
        ap.error("--max-tokens: 1..4096")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvx-bench-control-") as tmp:
        write_tiny_config(tmp)
        settings = {"model": TINY_MODEL, "prompts": list(PROMPTS), "max_tokens": args.max_tokens,
                    "concurrency": levels, "requests": args.requests, "rounds": args.rounds,
                    "warmup": args.warmup, "profile_requests": args.profile,
                    "pool_blocks": POOL_BLOCKS, "quick": args.quick,
                    "label": args.label}  # fmt: skip
        print(f"# control plane: {len(levels)} levels x {args.requests} requests x 3 modes",
              flush=True)  # fmt: skip
        try:
            result = run(args, levels, tmp, settings)
        except (BenchError, load.LoadError, httpx.HTTPError) as exc:
            print(f"bench_control: {exc}", file=sys.stderr)
            return 1
    result["target"] = target(result)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print()
    print(control_report.levels_table(result))
    print()
    print(control_report.profile_table(result))
    t, m = result["target"], result["machine"]
    print(f"\nP/D overhead at concurrency 1: p50 {t['pd_overhead_p50_ms']:.2f} ms, target "
          f"<= {t['target_ms']:g} ms: {'met' if t['met'] else 'MISSED'}")  # fmt: skip
    print(f"{result['elapsed_s']} s; load average {m['load_average_start']} -> "
          f"{m['load_average_end']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    if args.plot:
        control_report.plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
