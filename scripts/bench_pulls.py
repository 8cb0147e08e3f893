#!/usr/bin/env python3
"""Benchmark sidecar pull throughput by pulls in flight, and the cost of reading from many ranks.

Real ``kvxferd serve`` processes and real NIXL on loopback; a small Mamba2 hybrid
(``benchlib.pullrig.HYBRID``), 16-block pulls of ~0.5 MB, each pull one ``POST /v1/pulls/run``
on the decode sidecar (decode TP 1), sent as the vLLM connector sends it: a frame on the
engine socket's framed protocol (``--http`` sends engine calls as HTTP/JSON instead):

- in-flight sweep: one prefill sidecar, N pulls in flight (N in 1,4,16,64): pulls/s, p50/p99
  of the pull call, CPU seconds of each sidecar per pull;
- fan-in sweep: prefill TP 1,2,4,8 (one sidecar per prefill rank, as deployments run them;
  ``--pod``: one pod sidecar per prefill engine, ``serve --pod-ranks``), the same bytes per
  pull (the decode reads its units from every rank), 16 in flight (``--fanin-inflight``; 1
  gives the latency): pulls/s, p50, and cost(TP k) / cost(TP 1)
  against the issue's target (<= 2 at TP 8).

Holds are placed before each round (untimed; the prefill engine's side of the work); a round's
time runs from its first pull call to its last answer. The first round of every level is a
warm-up in which every pull is verified byte for byte (kvxferd.pattern) and every hold must be
released by its reader's notification; timed rounds check state and byte counts (and every
byte with --verify-all). ``--profile DIR`` runs the sidecars under cProfile (benchlib.sigprof),
profiling the timed rounds only; profiled runs are slower and not comparable to plain ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pstats
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from benchlib import cli, report  # noqa: E402
from benchlib.procs import Pool, SidecarProcess  # noqa: E402
from benchlib.pullrig import BenchError, Rank, Rig, pct, plan, slot_ids  # noqa: E402

from kvxferd.client import AsyncEngineClient  # noqa: E402

FULL = {"inflight": "1,4,16,64", "fanin": "1,2,4,8", "rounds": 3, "pulls": 256}
QUICK = {"inflight": "1,4,16", "fanin": "1,2", "rounds": 1, "pulls": 32}
FANIN_INFLIGHT = 16
PHASES = ("total", "handshake", "claim", "post", "wire")
SIGPROF = Path(__file__).resolve().parent / "benchlib" / "sigprof.py"
TARGET_FANIN_RATIO = 2.0


class Profiler:
    """cProfile windows in the sidecars (``--profile DIR``), summarised per pull."""

    def __init__(self, directory: str | None) -> None:
        self.dir = directory
        self._windows: dict[str, int] = {}

    def wrap(self, name: str) -> list[str]:
        return [str(SIGPROF), os.path.join(self.dir, name)] if self.dir else ["-m", "kvxferd"]

    @contextlib.contextmanager
    def window(self, ranks: dict[str, Rank], tag: str, out: dict) -> Iterator[None]:
        if not self.dir:
            yield
            return
        for r in ranks.values():
            os.kill(r.sidecar.proc.pid, signal.SIGUSR1)
        try:
            yield
        finally:
            for r in ranks.values():
                os.kill(r.sidecar.proc.pid, signal.SIGUSR2)
            for name in ranks:
                n = self._windows.get(name, 0)
                self._windows[name] = n + 1
                src = os.path.join(self.dir, f"{name}.{n}.prof")
                deadline = time.monotonic() + 30
                while not os.path.exists(src):
                    if time.monotonic() > deadline:
                        raise BenchError(f"no profile from {name} after 30 s")
                    time.sleep(0.05)
                dst = os.path.join(self.dir, f"{name}-{tag}.prof")
                os.replace(src, dst)
                out[name] = dst


def top(path: str, pulls: int, n: int = 15) -> list[dict]:
    """The ``n`` functions with most own time in a profile, per pull."""
    st = pstats.Stats(path)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore
        rows.append({
            "function": f"{Path(file).name}:{line}({func})",
            "calls_per_pull": nc / pulls,
            "own_ms_per_pull": tt * 1e3 / pulls,
            "cum_ms_per_pull": ct * 1e3 / pulls,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["own_ms_per_pull"])
    return rows[:n]


def phase_means(before: dict, after: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in PHASES:
        t1, c1 = after.get(k, (0.0, 0))
        t0, c0 = before.get(k, (0.0, 0))
        out[k] = (t1 - t0) / (c1 - c0) * 1e3 if c1 > c0 else None
    return out


async def _round(rig: Rig, dc: AsyncEngineClient, tickets: list, inflight: int, verify: bool
                 ) -> tuple[list[float], list[float]]:  # fmt: skip
    """Run the pulls of ``tickets`` with ``inflight`` workers (worker w: slot w)."""
    lat: list[float] = []
    sidecar: list[float] = []

    async def worker(w: int) -> None:
        for t in tickets[w::inflight]:
            if verify:
                rig.scrub(w)
            t0 = time.perf_counter()
            status = await dc.run_pull(rig.request(w, t))
            lat.append(time.perf_counter() - t0)
            sidecar.append(status.duration_s)
            rig.check(status)
            if verify:
                rig.verify(w)

    await asyncio.gather(*(worker(w) for w in range(inflight)))
    return lat, sidecar


async def measure(rig: Rig, inflight: int, args: argparse.Namespace, prof: Profiler, tag: str
                  ) -> dict:  # fmt: skip
    """One level: a verified warm-up round, then ``rounds`` timed rounds."""
    pulls = max(args.pulls, 2 * inflight)
    frames = not args.http
    dc = AsyncEngineClient(rig.decode.sidecar.socket, timeout_s=120.0, frames=frames)
    pcs = [AsyncEngineClient(r.sidecar.socket, timeout_s=120.0, frames=frames)
           for r in rig.prefills]  # fmt: skip
    tp = len(rig.prefills)
    ranks = {
        "decode": rig.decode,
        **({f"prefill-pod{tp}": rig.prefills[0]} if rig.pod else
           {f"prefill-tp{tp}-r{i}": r for i, r in enumerate(rig.prefills)}),
    }  # fmt: skip
    try:
        tickets = await rig.place_holds(pcs, pulls, inflight)
        await _round(rig, dc, tickets, inflight, verify=True)
        await rig.wait_released(pcs, tickets)
        verified = len(tickets)
        lat, sc, wall = [], [], 0.0
        cpu = {k: 0.0 for k in ranks}
        me = 0.0
        phases0 = rig.decode.sidecar.phase_sums()
        paths0 = rig.decode.sidecar.reads_by_path()
        profiles: dict[str, str] = {}
        with prof.window(ranks, tag, profiles):
            for _ in range(args.rounds):
                tickets = await rig.place_holds(pcs, pulls, inflight)
                c0 = {k: r.sidecar.cpu_seconds() for k, r in ranks.items()}
                m0 = _own_cpu()
                t0 = time.perf_counter()
                a, b = await _round(rig, dc, tickets, inflight, verify=args.verify_all)
                wall += time.perf_counter() - t0
                verified += len(tickets) if args.verify_all else 0
                await rig.wait_released(pcs, tickets)
                me += _own_cpu() - m0
                for k, r in ranks.items():
                    cpu[k] += r.sidecar.cpu_seconds() - c0[k]
                lat += a
                sc += b
        phases = phase_means(phases0, rig.decode.sidecar.phase_sums())
        paths = rig.decode.sidecar.reads_by_path()
        reads = {k: v - paths0.get(k, 0) for k, v in paths.items() if v - paths0.get(k, 0)}
    finally:
        for c in (dc, *pcs):
            await c.aclose()
    n = len(lat)
    prefill_cpu = sum(v for k, v in cpu.items() if k != "decode")
    row = {
        "inflight": inflight,
        "prefill_tp": len(rig.prefills),
        "pulls": n,
        "rounds": args.rounds,
        "bytes_per_pull": rig.expected_bytes,
        "pulls_per_s": n / wall,
        "p50_ms": pct(lat, 50) * 1e3,
        "p99_ms": pct(lat, 99) * 1e3,
        "sidecar_p50_ms": pct(sc, 50) * 1e3,
        "decode_cpu_ms_per_pull": cpu["decode"] * 1e3 / n,
        "prefill_cpu_ms_per_pull": prefill_cpu * 1e3 / n,
        "client_cpu_ms_per_pull": me * 1e3 / n,
        "decode_phase_mean_ms": phases,
        "decode_reads_by_path": reads,
        "verified_pulls": verified,
        "load_average": os.getloadavg()[0],
    }
    if profiles:
        row["profiles"] = {k: {"path": p, "top": top(p, n)} for k, p in profiles.items()}
    return row


def _own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@contextlib.contextmanager
def prefill_engine(tp: int, num_blocks: int, tmp: str, prof: Profiler, pod: bool = False
                   ) -> Iterator[list[Rank]]:  # fmt: skip
    """``tp`` prefill ranks (one sidecar each, started together; ``pod``: one sidecar serving
    them all, ``serve --pod-ranks``), registered; stopped after."""
    manifests = [plan(tp, r, num_blocks) for r in range(tp)]
    pools = [Pool(m) for m in manifests]
    ranks: list[Rank] = []
    try:
        if pod and tp > 1:
            (one,) = SidecarProcess.start_many(tmp, [f"prefill-pod{tp}"], wrap=prof.wrap,
                                               args=["--pod-ranks", str(tp)])  # fmt: skip
            procs = [one] * tp
        else:
            names = [f"prefill-tp{tp}-r{r}" for r in range(tp)]
            procs = SidecarProcess.start_many(tmp, names, wrap=prof.wrap)
        ranks = [Rank(s, m, p) for s, m, p in zip(procs, manifests, pools, strict=True)]
        with ThreadPoolExecutor(tp) as workers:  # a pod's registers wait for each other
            list(workers.map(Rank.register, ranks))
        yield ranks
    finally:
        for s in {id(r.sidecar): r.sidecar for r in ranks}.values():
            s.stop()
        for p in pools:
            p.close()


def print_rows(title: str, rows: list[dict], key: str) -> None:
    print(f"\n{title}")
    print(f"{key:>10} {'pulls/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'side p50':>8} "
          f"{'D cpu ms':>8} {'P cpu ms':>8} {'cost':>5}  decode READs")  # fmt: skip
    for r in rows:
        paths = " ".join(f"{k} {v}" for k, v in sorted(r["decode_reads_by_path"].items()))
        print(f"{r[key]:>10} {r['pulls_per_s']:8.1f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
              f"{r['sidecar_p50_ms']:8.2f} {r['decode_cpu_ms_per_pull']:8.2f} "
              f"{r['prefill_cpu_ms_per_pull']:8.2f} "
              f"{report.fmt(r.get('cost_vs_tp1'), '5.2f')}  {paths}")  # fmt: skip


def targets(result: dict) -> dict:
    out: dict = {}
    rates = [r["pulls_per_s"] for r in result["inflight"]]
    if len(rates) > 1:
        out["inflight_pulls_per_s"] = rates
        out["inflight_non_decreasing"] = all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    fan = {r["prefill_tp"]: r for r in result["fanin"]}
    if 1 in fan and len(fan) > 1:
        worst = max(fan)
        out["fanin_max_tp"] = worst
        out["fanin_cost_ratio"] = fan[worst]["cost_vs_tp1"]
        out["fanin_target"] = TARGET_FANIN_RATIO
        out["fanin_met"] = fan[worst]["cost_vs_tp1"] <= TARGET_FANIN_RATIO
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (~30 s)")
    ap.add_argument("--inflight", help="comma list of pulls in flight (in-flight sweep; '' skips)")
    ap.add_argument("--fanin", help="comma list of prefill TP sizes (fan-in sweep; '' skips)")
    ap.add_argument(
        "--fanin-inflight",
        type=int,
        default=FANIN_INFLIGHT,
        help=f"pulls in flight in the fan-in sweep (default {FANIN_INFLIGHT}; 1: latency)",
    )
    ap.add_argument("--rounds", type=int, help="timed rounds per level (after a verified one)")
    ap.add_argument("--pulls", type=int, help="pulls per round (at least 2 per slot)")
    ap.add_argument("--verify-all", action="store_true", help="byte-verify timed rounds too")
    ap.add_argument("--pod", action="store_true",
                    help="fan-in sweep: one pod sidecar (serve --pod-ranks) per prefill engine "
                    "instead of one sidecar per rank")  # fmt: skip
    ap.add_argument("--profile", metavar="DIR", help="cProfile the sidecars' timed rounds")
    ap.add_argument(
        "--http",
        action="store_true",
        help="engine calls as HTTP/JSON (default: frames, as the vLLM connector)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    cli.fill_defaults(args, QUICK, FULL)
    inflight = [int(x) for x in args.inflight.split(",") if x]
    fanin = [int(x) for x in args.fanin.split(",") if x]
    if (
        min(inflight + fanin, default=1) < 1
        or args.fanin_inflight < 1
        or args.rounds < 1
        or args.pulls < 1
    ):
        ap.error("--inflight/--fanin/--fanin-inflight/--rounds/--pulls: positive")
    if any(8 % t for t in fanin):
        ap.error("--fanin: TP sizes that shard the bench model (1, 2, 4, 8)")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    started = time.monotonic()
    prof = Profiler(args.profile)
    slots = max(inflight + [args.fanin_inflight if fanin else 1])
    result: dict = {
        "machine": report.machine(),
        "settings": {
            "inflight": inflight,
            "fanin": fanin,
            "fanin_inflight": args.fanin_inflight,
            "rounds": args.rounds,
            "pulls": args.pulls,
            "quick": args.quick,
            "verify_all": args.verify_all,
            "profile": bool(args.profile),
            "engine_wire": "http" if args.http else "frames",
            "pod": args.pod,
        },  # fmt: skip
        "inflight": [],
        "fanin": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvx-pulls-") as tmp:
        dm = plan(1, 0, slot_ids(plan(1, 0, 4), slots)[1])
        dpool = Pool(dm)
        try:
            (dside,) = SidecarProcess.start_many(tmp, ["decode"], wrap=prof.wrap)
            decode = Rank(dside, dm, dpool)
            try:
                decode.register()
                rig = Rig(decode, slots)
                for tp in sorted(set(fanin) | ({1} if inflight else set())):
                    with prefill_engine(tp, rig.num_blocks, tmp, prof, args.pod) as ranks:
                        rig.attach(ranks)
                        if tp == 1:
                            for n in inflight:
                                row = asyncio.run(measure(rig, n, args, prof, f"inflight{n}"))
                                result["inflight"].append(row)
                                print(f"# {n} in flight: {row['pulls_per_s']:.1f} pulls/s",
                                      flush=True)  # fmt: skip
                        if tp in fanin:
                            tag = f"fanin-tp{tp}"
                            row = asyncio.run(measure(rig, args.fanin_inflight, args, prof, tag))
                            result["fanin"].append(row)
                            print(f"# prefill TP {tp}: {row['pulls_per_s']:.1f} pulls/s",
                                  flush=True)  # fmt: skip
            finally:
                dside.stop()
        finally:
            dpool.close()
    base = next((r for r in result["fanin"] if r["prefill_tp"] == 1), None)
    for r in result["fanin"]:
        if base is not None:
            r["cost_vs_tp1"] = base["pulls_per_s"] / r["pulls_per_s"]
            r["p50_vs_tp1"] = r["p50_ms"] / base["p50_ms"]
            # CPU times tick at 10 ms: a short TP 1 level may read 0 (no ratio then)
            base_cpu = base["decode_cpu_ms_per_pull"]
            r["decode_cpu_vs_tp1"] = r["decode_cpu_ms_per_pull"] / base_cpu if base_cpu else None
    result["targets"] = targets(result)
    result["verified"] = True
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    if result["inflight"]:
        print_rows("in-flight sweep (prefill TP 1 -> decode TP 1)", result["inflight"], "inflight")
    if result["fanin"]:
        print_rows(f"fan-in sweep ({args.fanin_inflight} in flight, same bytes per pull)",
                   result["fanin"], "prefill_tp")  # fmt: skip
    for row in result["inflight"] + result["fanin"]:
        for name, p in row.get("profiles", {}).items():
            if name == "decode" or row["prefill_tp"] == 1:
                print(f"\nprofile {name} @ {row['inflight']} in flight, TP {row['prefill_tp']} "
                      "(own ms/pull, calls/pull):")  # fmt: skip
                for t in p["top"][:10]:
                    print(f"  {t['own_ms_per_pull']:7.3f} {t['calls_per_pull']:7.1f}  "
                          f"{t['function']}")  # fmt: skip
    print(f"\ntargets: {result['targets']}")
    print(f"{result['elapsed_s']} s; load average {result['machine']['load_average_start']} -> "
          f"{result['machine']['load_average_end']}")  # fmt: skip
    cli.write_outputs(result, args.json, None, lambda *_: None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
