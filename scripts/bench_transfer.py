#!/usr/bin/env python3
"""Benchmark kvxferd pulls against the transport ceiling, vLLM's descriptor scheme, UCX, memcpy.

For each layout (planner-made hybrid pools in shared memory), request size and block allocation
(contiguous or fragmented), in the same run and over the same bytes:

- kvxferd: prefill and decode ``kvxferd serve`` processes; hold on prefill, pull on decode, timed
  from the engine's pull call to the pull reported done (also the sidecar's own duration);
  every pull's bytes are verified (kvxferd.pattern) before its time counts;
- ceiling: the same volume per region as ONE descriptor per region, raw NIXL READ from the
  prefill sidecar's memory, initiator busy-polling (no progress thread), and with one;
- per-layer: vLLM's connector scheme (one descriptor per attention layer per kernel block per
  K and V, per mamba layer per block per conv section and SSM) driven through NIXL directly,
  with a progress thread (as vLLM and the sidecars run) and busy-polling;
- ucx: ``ucx_perftest -t ucp_get`` over loopback at the mean kvxferd descriptor size;
- memcpy: ``np.copyto`` of each region's volume, one thread;
- kernel TCP (``--tls`` sets other than ``default``): the same byte count over loopback TCP
  sockets between two processes, no UCX (benchlib.tcp): what any transport over TCP is bounded by.

Re-blocking layouts (``*-reblock``) give the prefill other planner options than the decode, so
the sides' block sizes (and grouping) differ and the pull maps tokens (kvxferd.descriptors
.reblock); vLLM's scheme pairs block ids and has no such case (its columns stay empty). Compare
their kvxferd/ceiling and descriptor count with the same layout at equal block sizes.

GB/s are 1e9 B/s, medians of ``--repeat`` runs after ``--warmup`` runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO

from benchlib import cli, raw, report, tcp, ucx  # noqa: E402
from benchlib.procs import SENTINEL, Pool, SidecarProcess, plan  # noqa: E402

from kvxferd.client import EngineClient  # noqa: E402
from kvxferd.config import Config  # noqa: E402
from kvxferd.descriptors import ReadPlan, plan_pull, plan_read, read_geometry  # noqa: E402
from kvxferd.descriptors.reference import reference_plan  # noqa: E402
from kvxferd.descriptors.staging import stage_plans  # noqa: E402
from kvxferd.pattern import (  # noqa: E402
    verify_pattern,
    verify_token_pattern,
    write_pattern,
    write_token_pattern,
)
from kvxferd.wire import HoldRequest, Manifest, PullRequest  # noqa: E402

LAYOUTS = {
    # Mamba2 hybrid with fp32 SSM state: 784-token blocks split into 16-token kernel blocks.
    "mamba2-hybrid": ("granite-4.0-h-tiny", {"mamba_ssm_cache_dtype": "float32"}),
    # Same model, bf16 state: 400-token blocks, kernel block = block.
    "mamba2-hybrid-bf16": ("granite-4.0-h-tiny", {}),
    # Gated DeltaNet hybrid: 544-token blocks, 12 regions.
    "gdn-hybrid": ("qwen3-next-80b-a3b", {}),
    # Same decode; the prefill packs 2 attention layers per page: 272-token blocks, 7 groups.
    "gdn-hybrid-reblock": ("qwen3-next-80b-a3b", {}),
}
PREFILL_OPTIONS = {"gdn-hybrid-reblock": {"attn_pack_size": 2}}
"""Prefill planner options where they differ from the decode's (re-blocking layouts)."""
FULL = {
    "layouts": "mamba2-hybrid,mamba2-hybrid-bf16,gdn-hybrid,gdn-hybrid-reblock",
    "tokens": "1024,4096,16384,32768",
    "repeat": 5,
    "warmup": 1,
}
QUICK = {
    "layouts": "mamba2-hybrid,gdn-hybrid,gdn-hybrid-reblock",
    "tokens": "1024",
    "repeat": 2,
    "warmup": 1,
}
PATTERNS = ("contiguous", "fragmented")
PULL_TIMEOUT_S = 120.0


class BenchError(RuntimeError):
    """The benchmark cannot report a number (a pull failed or moved wrong bytes)."""


@dataclass
class Setup:
    """One layout's pair of sidecars, their pools, and the bench-side busy-polling reader."""

    name: str
    pm: Manifest
    dm: Manifest
    ppool: Pool
    dpool: Pool
    prefill: SidecarProcess
    decode: SidecarProcess
    busy: raw.RawReader
    pc: EngineClient
    """The prefill engine's client (holds, release feed), framed like an engine's."""
    dc: EngineClient
    """The decode engine's client (pulls), framed like an engine's."""
    released_cursor: int = 0

    @property
    def reblock(self) -> bool:
        """The sides' block sizes or grouping differ: the pull maps tokens."""
        return self.name in PREFILL_OPTIONS

    def write(self, ids: list[list[int]], tokens: int, seed: int) -> None:
        """The prefill's pattern (by token when re-blocking, else by block)."""
        if self.reblock:
            write_token_pattern(self.pm, self.ppool.views, ids, tokens, seed)
        else:
            write_pattern(self.pm, self.ppool.views, ids, seed)

    def verify(self, ids: list[list[int]], tokens: int, seed: int) -> object:
        """The first wrong byte of the decode's blocks, or None."""
        if self.reblock:
            return verify_token_pattern(self.dm, self.dpool.views, ids, tokens, seed)
        return verify_pattern(self.dm, self.dpool.views, ids, seed)


def blocks_per_group(m: Manifest, tokens: int) -> list[int]:
    """Attention groups: the blocks holding ``tokens``; mamba groups: one (the running state)."""
    return [1 if g.kind == "mamba" else math.ceil(tokens / g.block_size) for g in m.groups]


def allocate(counts: list[int], num_blocks: int, pattern: str, seed: int) -> list[list[int]]:
    """Block ids per group, disjoint (one pool): a run from 1, or a shuffled sample."""
    n = sum(counts)
    if pattern == "contiguous":
        ids = np.arange(1, n + 1)
    else:
        ids = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))[:n]
    out, start = [], 0
    for c in counts:
        out.append([int(b) for b in ids[start : start + c]])
        start += c
    return out


def contiguous_runs(local: list[list[int]], remote: list[list[int]]) -> int:
    """Runs of pairs whose local and remote ids both go up by one, summed over groups."""
    runs = 0
    for lo, re in zip(local, remote, strict=True):
        a, b = np.asarray(lo), np.asarray(re)
        if a.size:
            runs += 1 + int(np.count_nonzero((np.diff(a) != 1) | (np.diff(b) != 1)))
    return runs


def scrub(pool: Pool, p: ReadPlan) -> None:
    """Overwrite every byte the plan writes with SENTINEL, so verification proves the pull."""
    for r, off, n in zip(
        p.local_region.tolist(), p.local_offset.tolist(), p.length.tolist(), strict=True
    ):
        pool.views[r][off : off + n] = SENTINEL


def wait_released(s: Setup, hold_id: str, timeout_s: float = 30.0) -> None:
    """Poll the prefill release feed (bounded) until ``hold_id`` was released."""
    deadline = time.monotonic() + timeout_s
    while True:
        feed = s.pc.released(s.released_cursor)
        s.released_cursor = feed.cursor
        if any(h.hold_id == hold_id for h in feed.holds):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"hold {hold_id} not released after {timeout_s} s")
        time.sleep(0.005)


def pull_once(s: Setup, pids, dids, tokens: int, seed: int, p: ReadPlan) -> tuple[float, object]:
    """One verified hold -> pull -> done; returns (engine-side seconds, PullStatus)."""
    scrub(s.dpool, p)
    ticket = s.pc.hold(
        HoldRequest(request_id=f"bench-{uuid.uuid4().hex[:8]}", block_ids=pids, num_tokens=tokens)
    )
    t0 = time.perf_counter()
    req = PullRequest(
        tickets=[ticket], block_ids=dids, num_tokens=tokens, deadline_s=PULL_TIMEOUT_S
    )
    status = s.dc.run_pull(req)  # one engine call per pull, as the engines make it
    client_s = time.perf_counter() - t0
    if status.state != "done":
        raise BenchError(f"pull ended {status.state}: {status.reason} {status.detail}")
    bad = s.verify(dids, tokens, seed)
    if bad is not None:
        raise BenchError(f"pull reported done but moved wrong bytes: {bad}")
    if status.kv_bytes + status.state_bytes != p.total_bytes:
        raise BenchError(
            f"pull moved {status.kv_bytes + status.state_bytes} B, expected {p.total_bytes}"
        )
    wait_released(s, ticket.hold_id)
    return client_s, status


def run_case(
    s: Setup, tokens: int, pattern: str, args: argparse.Namespace, tcp_ceiling: bool = False
) -> dict:
    """Every measurement of one (layout, request size, allocation pattern); ``tcp_ceiling``:
    also the kernel's loopback TCP (runs under a ``--tls`` set other than ``default``)."""
    counts = blocks_per_group(s.dm, tokens)
    seed = (tokens * 7 + PATTERNS.index(pattern)) & 0xFFFF
    pids = allocate(blocks_per_group(s.pm, tokens), s.pm.num_blocks, pattern, seed)
    dids = allocate(counts, s.dm.num_blocks, pattern, seed + 1)
    s.write(pids, tokens, seed)
    lid = [np.asarray(g, dtype=np.int64) for g in dids]
    rid = [np.asarray(g, dtype=np.int64) for g in pids]

    def plan_now() -> ReadPlan:  # what the decode sidecar computes
        if s.reblock:
            return plan_pull(read_geometry(s.dm, s.pm), dids, pids, tokens, tokens)
        return plan_read(s.dm, s.pm, lid, rid)

    ours = plan_now()
    ref = None if s.reblock else reference_plan(s.dm, s.pm, lid, rid)
    nbytes = ours.total_bytes
    if ref is not None and (ref.total_bytes != nbytes or int(ref.length.sum()) != nbytes):
        raise BenchError(f"reference scheme moves {ref.total_bytes} B, kvxferd {nbytes} B")
    geometry = read_geometry(s.dm, s.pm)  # the sidecar keeps it per peer epoch
    t_plan = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan_pull(geometry, dids, pids, tokens, tokens)  # what the sidecar does per pull
        t_plan.append(time.perf_counter() - t0)

    # (a) kvxferd pulls, each verified.
    for _ in range(args.warmup):
        pull_once(s, pids, dids, tokens, seed, ours)
    before = s.decode.phase_sums()
    client, sidecar = [], []
    status = None
    for _ in range(args.repeat):
        c, status = pull_once(s, pids, dids, tokens, seed, ours)
        client.append(c)
        sidecar.append(status.duration_s)
    after = s.decode.phase_sums()
    # The sidecar posts the plan, or its staged form (whole runs into its staging buffer, the
    # rows copied into place after: kvxferd.descriptors.staging) where that pays, by default.
    cfg = Config()
    staged = stage_plans([ours], [len(s.pm.regions)], min_descriptors=cfg.staging_min_descriptors,
                         max_bytes=cfg.staging_bytes)  # fmt: skip
    posted = status.descriptors if status is not None else ours.num_descriptors
    if posted not in (ours.num_descriptors, staged.num_runs if staged else None):
        raise BenchError(
            f"sidecar posted {posted} descriptors, plan has {ours.num_descriptors}"
            + (f" ({staged.num_runs} staged)" if staged else "")
        )
    phases = {}
    for k, (tot, cnt) in after.items():
        t0, c0 = before.get(k, (0.0, 0))
        if cnt > c0:
            phases[k] = (tot - t0) / (cnt - c0) * 1e3
    prof = {
        "client": statistics.mean(client) * 1e3,
        "sidecar_total": phases.get("total"),
        "handshake": phases.get("handshake"),
        "claim": phases.get("claim"),
        "post": phases.get("post"),
        "wire": phases.get("wire"),
        "plan_read": statistics.median(t_plan) * 1e3,
    }
    if None not in (prof["sidecar_total"], prof["claim"], prof["post"], prof["wire"]):
        # The claim runs concurrently with post and wire (issue 11): the pull waits for the longer.
        read = prof["post"] + prof["wire"]
        prof["other"] = prof["sidecar_total"] - max(prof["claim"], read)

    # (c) first, once, verified: the reference table really moves the pulled bytes.
    none = {"gbps": None, "samples_gbps": []}
    if ref is not None:
        scrub(s.dpool, ours)
        s.busy.read_s(ref)
        bad = s.verify(dids, tokens, seed)
        if bad is not None:
            raise BenchError(f"per-layer scheme moved wrong bytes: {bad}")

    ceil = raw.ceiling_plan(ours, len(s.dm.regions), len(s.pm.regions))
    w, n = args.warmup, args.repeat
    ceiling = raw.median_gbps(nbytes, lambda: s.busy.read_s(ceil), w, n)
    pl_busy = none if ref is None else raw.median_gbps(nbytes, lambda: s.busy.read_s(ref), w, n)
    prog = raw.RawReader(s.prefill.peer, s.dm, s.dpool, progress_thread=True)
    try:
        ceiling_pt = raw.median_gbps(nbytes, lambda: prog.read_s(ceil), w, n)
        per_layer = none if ref is None else raw.median_gbps(nbytes, lambda: prog.read_s(ref), w, n)
    finally:
        prog.close()
    memcpy = raw.median_gbps(nbytes, lambda: raw.memcpy_s(s.ppool.views, s.dpool.views, ceil), w, n)
    u = ucx.ucp_get(nbytes // max(1, ours.num_descriptors), nbytes)
    tcp_kernel = tcp.ceiling(nbytes, w, n) if tcp_ceiling else {"gbps": None, "streams": None}

    kx = statistics.median(nbytes / c / 1e9 for c in client)
    kx_sc = statistics.median(nbytes / c / 1e9 for c in sidecar)
    runs = None if s.reblock else contiguous_runs(dids, pids)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if not a or not b else a / b

    return {
        "layout": s.name,
        "model": LAYOUTS[s.name][0],
        "tokens": tokens,
        "pattern": pattern,
        "blocks_per_group": counts,
        "bytes": nbytes,
        "kv_bytes": ours.kv_bytes,
        "state_bytes": ours.state_bytes,
        "kvxferd_gbps": kx,
        "kvxferd_sidecar_gbps": kx_sc,
        "kvxferd_samples_gbps": [round(nbytes / c / 1e9, 3) for c in client],
        "ceiling_gbps": ceiling["gbps"],
        "ceiling_progress_gbps": ceiling_pt["gbps"],
        "per_layer_gbps": per_layer["gbps"],
        "per_layer_busy_gbps": pl_busy["gbps"],
        "ucx_gbps": u.gbps,
        "ucx_reason": u.reason,
        "ucx_message_bytes": u.message_bytes,
        "ucx_iterations": u.iterations,
        "ucx_lane": u.lane,
        "memcpy_gbps": memcpy["gbps"],
        "tcp_kernel_gbps": tcp_kernel["gbps"],
        "tcp_kernel_streams": tcp_kernel["streams"],
        "kvxferd_descriptors": ours.num_descriptors,
        "kvxferd_posted": posted,  # fewer than its descriptors: the READ was staged
        "per_layer_descriptors": None if ref is None else ref.num_descriptors,
        "ceiling_descriptors": ceil.num_descriptors,
        "contiguous_runs": runs,
        "descriptor_bound": None if runs is None else runs * len(s.dm.regions),
        "prefill_block_sizes": sorted({g.block_size for g in s.pm.groups}),
        "decode_block_sizes": sorted({g.block_size for g in s.dm.groups}),
        "kvxferd_vs_ceiling": ratio(kx, ceiling["gbps"]),
        "kvxferd_vs_ceiling_progress": ratio(kx, ceiling_pt["gbps"]),
        "kvxferd_vs_per_layer": ratio(kx, per_layer["gbps"]),
        "kvxferd_vs_per_layer_busy": ratio(kx, pl_busy["gbps"]),
        "kvxferd_vs_memcpy": ratio(kx, memcpy["gbps"]),
        "kvxferd_vs_tcp_kernel": ratio(kx, tcp_kernel["gbps"]),
        "tcp_kernel_vs_memcpy": ratio(tcp_kernel["gbps"], memcpy["gbps"]),
        "samples_gbps": {
            "ceiling": ceiling["samples_gbps"],
            "ceiling_progress": ceiling_pt["samples_gbps"],
            "per_layer": per_layer["samples_gbps"],
            "per_layer_busy": pl_busy["samples_gbps"],
            "memcpy": memcpy["samples_gbps"],
        },
        "profile_ms": prof,
        "verified": True,
    }


def run_layout(
    name: str,
    tokens: list[int],
    args: argparse.Namespace,
    tmp: str,
    idle: dict,
    tcp_ceiling: bool = False,
) -> list[dict]:
    """Start a sidecar pair with pools sized for the largest request, run every case."""
    config, options = LAYOUTS[name]
    poptions = PREFILL_OPTIONS.get(name, options)
    probes = (plan(config, 4, options), plan(config, 4, poptions))
    need = max(sum(blocks_per_group(probe, t)) for t in tokens for probe in probes)
    num_blocks = 2 * need + 1  # room to fragment; block 0 stays unused (vLLM's null block)
    pm, dm = plan(config, num_blocks, poptions), plan(config, num_blocks, options)
    stack: list = []
    try:
        ppool = Pool(pm)
        stack.append(ppool.close)
        dpool = Pool(dm)
        stack.append(dpool.close)
        prefill, decode = SidecarProcess.start_many(tmp, [f"{name}-prefill", f"{name}-decode"])
        stack.extend([prefill.stop, decode.stop])
        with prefill.client() as pc, decode.client() as dc:
            pc.register(pm, ppool.specs())
            dc.register(dm, dpool.specs())
        if not idle:
            a, t0 = prefill.cpu_seconds(), time.monotonic()
            time.sleep(1.0)
            idle["idle_sidecar_cpu_fraction"] = round(
                (prefill.cpu_seconds() - a) / (time.monotonic() - t0), 2
            )
        busy = raw.RawReader(prefill.peer, dm, dpool, progress_thread=False)
        stack.append(busy.close)
        pc, dc = prefill.client(frames=True), decode.client(frames=True)
        stack.extend([pc.close, dc.close])
        s = Setup(name, pm, dm, ppool, dpool, prefill, decode, busy, pc, dc)
        pool_mb = sum(r.size_bytes for r in pm.regions) / 1e6
        print(
            f"# {name}: {config} {options or ''}"
            + (f" (prefill {poptions})" if poptions != options else "")
            + f", {len(pm.regions)} regions, "
            f"{num_blocks} blocks x 2 pools = {2 * pool_mb:.0f} MB",
            flush=True,
        )
        cases = []
        for t in tokens:
            for pattern in PATTERNS:
                c = run_case(s, t, pattern, args, tcp_ceiling)
                print(
                    f"  {t:>6} {pattern:10} {c['bytes'] / 1e6:8.1f} MB  kvxferd "
                    f"{c['kvxferd_gbps']:.2f}  ceiling {c['ceiling_gbps']:.2f}  per-layer "
                    f"{report.fmt(c['per_layer_gbps'], '.2f')} GB/s, "
                    f"{c['kvxferd_descriptors']} descriptors",
                    flush=True,
                )
                cases.append(c)
        return cases
    finally:
        for undo in reversed(stack):
            undo()


NOTES = {
    "kvxferd_gbps": "bytes / (engine run_pull call -> its final status), median; the call goes "
    "over the framed engine protocol (<socket>.frames, kvxferd/api/frames.py), one call per pull "
    "that answers when the pull ended, as the sim and vLLM engines make it (before: HTTP/JSON "
    "pull + status long-poll, about 2-3 ms more per pull). Includes the claim HTTP to prefill "
    "(concurrent with the READ), planning, NIXL descriptor build, post and wire. The peer "
    "handshake is cached by the warm-up pull.",
    "kvxferd_sidecar_gbps": "bytes / the sidecar's own pull duration (claim .. READ done).",
    "ceiling_gbps": "one NIXL descriptor per region for the same per-region volume, READ from "
    "the prefill sidecar's registered memory by the bench process (no progress thread, "
    "busy-polls); time = descriptor lists + initialize_xfer + post + wait.",
    "ceiling_progress_gbps": "same, initiator agent with a NIXL progress thread (the sidecar's "
    "configuration).",
    "per_layer_gbps": "vLLM's per-layer, per-kernel-block, K/V-split descriptor table "
    "(kvxferd.descriptors.reference.reference_plan) READ through NIXL directly, initiator with "
    "a progress thread (as vLLM's connector and the sidecars run); no control plane included.",
    "per_layer_busy_gbps": "same table, busy-polling initiator.",
    "ucx_gbps": "ucx_perftest -t ucp_get between two processes on loopback (libucx wheel), "
    "message = mean kvxferd descriptor size; MB/s (2**20) converted to GB/s.",
    "memcpy_gbps": "np.copyto of each region's volume, prefill pool -> decode pool, one thread.",
    "tcp_kernel_gbps": "the same byte count sent over 1 or 2 loopback TCP connections (the "
    "better median) from the bench process to a receiver process, recv_into preallocated "
    "memory, no UCX (scripts/benchlib/tcp.py): no transport over TCP moves more here. Measured "
    "for --tls sets other than 'default'.",
    "verified": "every timed and warm-up kvxferd pull, and the per-layer table once, were "
    "checked byte for byte (kvxferd.pattern) before their time counted.",
}


@contextlib.contextmanager
def ucx_tls(tls: str) -> Iterator[None]:
    """``UCX_TLS`` for everything started inside (sidecars, bench agents, ucx_perftest):
    ``default`` leaves UCX's own choice (what the environment says)."""
    before = os.environ.get("UCX_TLS")
    if tls != "default":
        os.environ["UCX_TLS"] = tls
    print(f"# UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}", flush=True)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 1 minute)")
    ap.add_argument("--layouts", help=f"comma list of {sorted(LAYOUTS)}")
    ap.add_argument("--tokens", help="comma list of request sizes in tokens")
    ap.add_argument("--repeat", type=int, help="timed runs per measurement, median (default 5)")
    ap.add_argument("--warmup", type=int, help="untimed runs before each measurement (1)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw throughput vs request size")
    ap.add_argument(
        "--tls",
        default="default",
        help="comma list of UCX transport sets, each case runs once per set: 'default' (UCX "
        "picks: cma/tcp on loopback) or a UCX_TLS value such as 'tcp' (default: default)",
    )
    args = ap.parse_args(argv)
    cli.fill_defaults(args, QUICK, FULL)
    layouts = cli.names(ap, "--layouts", args.layouts, LAYOUTS)
    tokens = sorted(int(t) for t in args.tokens.split(",") if t)
    tls_sets = [x.strip() for x in args.tls.split(",") if x.strip()]
    if not tls_sets or len(set(tls_sets)) != len(tls_sets):
        ap.error("--tls: a non-empty comma list without repeats")
    if args.repeat < 1 or args.warmup < 0 or not tokens or min(tokens) < 1:
        ap.error("--repeat >= 1, --warmup >= 0, --tokens positive")
    started = time.monotonic()
    result = {
        "machine": report.machine(),
        "settings": {
            "layouts": {
                n: {
                    "model": LAYOUTS[n][0],
                    "options": LAYOUTS[n][1],
                    "prefill_options": PREFILL_OPTIONS.get(n, LAYOUTS[n][1]),
                }
                for n in layouts
            },
            "tokens": tokens,
            "patterns": list(PATTERNS),
            "repeat": args.repeat,
            "warmup": args.warmup,
            "quick": args.quick,
            "tls": tls_sets,
        },
        "notes": NOTES,
        "cases": [],
    }
    idle: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvx-bench-") as tmp:
        for tls in tls_sets:
            with ucx_tls(tls):
                for name in layouts:
                    for case in run_layout(name, tokens, args, tmp, idle, tls != "default"):
                        case["tls"] = tls
                        result["cases"].append(case)
    result["machine"].update(idle)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print()
    print(report.table(result))
    print()
    print(report.profile_table(result))
    bounds = report.tcp_bounds(result)
    if bounds:
        print("\nover TCP, against the kernel's own loopback TCP:\n" + bounds)
    mach = result["machine"]
    print(
        f"\n{len(result['cases'])} cases in {result['elapsed_s']} s; load average "
        f"{mach['load_average_start']} -> {mach['load_average_end']}"
    )
    cli.write_outputs(result, args.json, args.plot, report.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
