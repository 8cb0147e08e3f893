#!/usr/bin/env python3
"""What ``--prepped-reads`` costs once per peer epoch: table rows at real pool sizes, and the
time and memory NIXL takes to prepare local + remote lists of that many rows.

Two parts, both printed (and written with ``--json``):
- rows: the prepared tables' rows for bundled configs at pool sizes of ``--blocks`` (pure
  descriptor math, no memory allocated) and the time to build them;
- prep: two real NIXL agents in this process, each with a POSIX shared-memory region; the time
  and resident-memory growth of ``prep_local`` + ``prep_remote`` for ``--rows`` synthetic rows.

Run: ``UCX_NET_DEVICES=lo .venv/bin/python scripts/bench_prepped.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvxferd import descriptors  # noqa: E402
from kvxferd.layout import planner, presets  # noqa: E402
from kvxferd.memory import SharedMemoryRegion  # noqa: E402
from kvxferd.sidecar.peerviews import PREP_MAX_ROWS  # noqa: E402
from kvxferd.transport import Agent  # noqa: E402

CONFIGS = ("nemotron-h-8b", "qwen3-next-80b-a3b", "jamba-mini-1.5", "llama-3.1-8b")
DESC_BYTES = 64  # synthetic rows: 64-byte descriptors 64 bytes apart


def _rss_mib() -> float:
    """Peak resident set of this process, MiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rows_table(blocks: list[int], tp: int) -> list[dict]:
    """Prepared-table rows and build time per config and pool size (no cap applied)."""
    out = []
    for cfg in CONFIGS:
        for n in blocks:
            m = planner.plan_manifest(
                presets.load_hf_config(cfg), planner.PlanOptions(num_blocks=n, tp_size=tp)
            )
            geo = descriptors.read_geometry(m, m)
            t0 = time.perf_counter()
            pg = descriptors.prepped_geometry(geo, max_rows=1 << 40)
            build_s = time.perf_counter() - t0
            rows = 0 if pg is None else pg.num_rows
            out.append({
                "config": cfg, "tp": tp, "blocks": n, "rows": rows,
                "build_ms": round(build_s * 1e3, 2), "within_cap": rows <= PREP_MAX_ROWS,
            })  # fmt: skip
    return out


def prep_table(rows: list[int]) -> list[dict]:
    """Wall time and peak-RSS growth of preparing a local and a remote list of N rows."""
    size = max(rows) * DESC_BYTES
    out = []
    a_reg = SharedMemoryRegion.create(f"kvx-prep-a-{id(rows)}", size)
    b_reg = SharedMemoryRegion.create(f"kvx-prep-b-{id(rows)}", size)
    try:
        with Agent("prep-a", progress_thread=False) as a, Agent("prep-b") as b:
            a.register(a_reg)
            b.register(b_reg)
            remote = a.add_remote(b.get_agent_metadata())
            for n in rows:
                offs = np.arange(n, dtype=np.uint64) * DESC_BYTES
                lens = np.full(n, DESC_BYTES, dtype=np.uint64)
                local = (np.uint64(a_reg.base_addr) + offs, lens)
                rem = (np.uint64(b_reg.base_addr) + offs, lens)
                rss0 = _rss_mib()
                t0 = time.perf_counter()
                lp = a.prep_local(local)
                t1 = time.perf_counter()
                rp = a.prep_remote(remote, rem)
                t2 = time.perf_counter()
                out.append({
                    "rows": n, "prep_local_ms": round((t1 - t0) * 1e3, 1),
                    "prep_remote_ms": round((t2 - t1) * 1e3, 1),
                    "peak_rss_growth_mib": round(_rss_mib() - rss0, 1),
                })  # fmt: skip
                lp.release()
                rp.release()
    finally:
        for reg in (a_reg, b_reg):
            reg.close()  # the owner also unlinks
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="2000,8000,32000", help="pool sizes (blocks), comma list")
    p.add_argument("--tp", type=int, default=1, help="TP size of both sides")
    p.add_argument("--rows", default="10000,100000,1000000", help="synthetic rows, comma list")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    blocks = [int(x) for x in args.blocks.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    result = {"rows": rows_table(blocks, args.tp), "prep": prep_table(rows)}
    print(f"{'config':22} {'blocks':>7} {'rows':>10} {'build ms':>9} within cap {PREP_MAX_ROWS}")
    for r in result["rows"]:
        print(f"{r['config']:22} {r['blocks']:7} {r['rows']:10} {r['build_ms']:9} "
              f"{r['within_cap']}")  # fmt: skip
    print(f"{'rows':>10} {'prep_local ms':>14} {'prep_remote ms':>15} {'peak RSS +MiB':>14}")
    for r in result["prep"]:
        print(f"{r['rows']:10} {r['prep_local_ms']:14} {r['prep_remote_ms']:15} "
              f"{r['peak_rss_growth_mib']:14}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
