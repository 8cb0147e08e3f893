#!/usr/bin/env python3
"""Per-pull request-independent costs: rank ownership and planning of a 1k-token pull (ms).

Run: PYTHONPATH=. .venv/bin/python scripts/bench_pull_plan.py (medians of 20 calls)."""

import statistics
import time

import numpy as np

from kvxferd import descriptors
from kvxferd.layout import planner, presets
from kvxferd.sidecar.pull_request import unread_ranks


def t(f, n=20):
    f()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


for cfg, tp in (("qwen3.5-397b-a17b", 8), ("jamba-mini-1.5", 1), ("jamba-mini-1.5", 8)):
    d = planner.plan_manifest(
        presets.load_hf_config(cfg), planner.PlanOptions(num_blocks=2000, tp_size=tp, tp_rank=0)
    )
    p = planner.plan_manifest(
        presets.load_hf_config(cfg), planner.PlanOptions(num_blocks=2000, tp_size=tp, tp_rank=0)
    )
    print(
        cfg,
        tp,
        "layers",
        sum(len(g.layers) for g in d.groups),
        "groups",
        len(d.groups),
        "bs",
        [g.block_size for g in d.groups][:3],
    )
    print(
        "  source_ranks ms",
        t(lambda: descriptors.source_ranks(d, tp)),
        " unread_ranks ms",
        t(lambda: unread_ranks(d, tp)),
    )
    geo = descriptors.read_geometry(d, p)
    bs = d.groups[0].block_size
    ids = [
        list(range(1, 1 + -(-1024 // g.block_size))) if g.kind != "mamba" else [1] for g in d.groups
    ]
    print(
        "  plan_pull 1k ms",
        t(lambda: descriptors.plan_pull(geo, ids, ids)),
        "descs",
        descriptors.plan_pull(geo, ids, ids).num_descriptors,
    )
print("--- prepped")
for cfg, tp, opts in (
    ("granite-4.0-h-tiny", 1, {"mamba_ssm_cache_dtype": "float32"}),
    ("qwen3-next-80b-a3b", 1, {}),
    ("qwen3.5-397b-a17b", 8, {}),
    ("jamba-mini-1.5", 1, {}),
):
    d = planner.plan_manifest(
        presets.load_hf_config(cfg), planner.PlanOptions(num_blocks=2000, tp_size=tp, **opts)
    )
    geo = descriptors.read_geometry(d, d)
    t0 = time.perf_counter()
    pg = descriptors.prepped_geometry(geo)
    tb = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    for pat in ("contiguous", "fragmented"):
        ids = []
        nxt = 1
        perm = rng.permutation(np.arange(1, 2000))
        for g in d.groups:
            n = -(-1024 // g.block_size) if g.kind != "mamba" else 1
            if pat == "contiguous":
                ids.append(list(range(nxt, nxt + n)))
            else:
                ids.append([int(x) for x in perm[nxt : nxt + n]])
            nxt += n
        pl = descriptors.plan_pull(geo, ids, ids)
        ip = pg.plan(ids, ids) if pg else None
        print(
            f"  {cfg} tp{tp} {pat}: plan_pull {t(lambda: descriptors.plan_pull(geo, ids, ids)):.3f} ms ({pl.num_descriptors} descs)",
            f"index plan {t(lambda: pg.plan(ids, ids)):.3f} ms ({ip.num_descriptors} idx, runs {ip.runs})"
            if pg
            else "not prepped",
            f"rows {pg.num_rows if pg else 0} build {tb * 1e3:.1f} ms",
        )
