#!/usr/bin/env python3
"""Per-pull request-independent costs: rank ownership and planning of a 1k-token pull and of a
one-block pull (one block per group, what a short prompt reads) (ms).

Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_pull_plan.py`` (medians of 20 calls after one
warm-up); planner manifests with 2000 blocks, contiguous and fragmented (shuffled) block ids.
The last section plans a decode TP 1 rank's pull from prefill TP 2, 4 and 8 both ways: one
``plan_pull`` per prefill rank, and all ranks at once (``descriptors.fanin``, what the sidecar
does); the ratio is per-rank time / stacked time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from benchlib.timing import median_s

from kvxferd import descriptors
from kvxferd.descriptors.fanin import fan_in_geometry
from kvxferd.errors import ManifestError
from kvxferd.layout import planner, presets
from kvxferd.sidecar.pull_request import unread_ranks

BLOCKS = 2000
TOKENS = 1024


def median_ms(f: Callable[[], object]) -> float:
    """Median wall time of ``f`` in milliseconds (20 calls after one warm-up)."""
    return median_s(f, 20, warmup=1) * 1e3


def manifest(cfg: str, tp: int, **opts: object):
    """A planned manifest (rank 0 of ``tp``)."""
    o = planner.PlanOptions(num_blocks=BLOCKS, tp_size=tp, **opts)  # type: ignore[arg-type]
    return planner.plan_manifest(presets.load_hf_config(cfg), o)


def ids_for(m, pattern: str, rng: np.random.Generator, tokens: int = TOKENS) -> list[list[int]]:
    """Block ids of a ``tokens``-token request, one list per group, disjoint."""
    perm = rng.permutation(np.arange(1, BLOCKS))
    out, nxt = [], 0
    for g in m.groups:
        n = 1 if g.kind == "mamba" else -(-tokens // g.block_size)
        run = range(nxt + 1, nxt + 1 + n) if pattern == "contiguous" else perm[nxt : nxt + n]
        out.append([int(x) for x in run])
        nxt += n
    return out


def main() -> None:
    for cfg, tp in (("qwen3.5-397b-a17b", 8), ("jamba-mini-1.5", 1), ("jamba-mini-1.5", 8)):
        m = manifest(cfg, tp)
        src = median_ms(lambda m=m, tp=tp: descriptors.source_ranks(m, tp))
        unr = median_ms(lambda m=m, tp=tp: unread_ranks(m, tp))
        print(f"{cfg} TP {tp}: source_ranks {src:.3f} ms, unread_ranks {unr:.3f} ms")
    rng = np.random.default_rng(0)
    for cfg, tp, opts in (
        ("granite-4.0-h-tiny", 1, {"mamba_ssm_cache_dtype": "float32"}),
        ("qwen3-next-80b-a3b", 1, {}),
        ("qwen3.5-397b-a17b", 8, {}),
        ("jamba-mini-1.5", 1, {}),
    ):
        m = manifest(cfg, tp, **opts)
        geo = descriptors.read_geometry(m, m)
        t0 = time.perf_counter()
        pg = descriptors.prepped_geometry(geo)
        build = (time.perf_counter() - t0) * 1e3
        for pattern in ("contiguous", "fragmented"):
            ids = ids_for(m, pattern, rng)
            plan = descriptors.plan_pull(geo, ids, ids)
            t_plan = median_ms(lambda geo=geo, ids=ids: descriptors.plan_pull(geo, ids, ids))
            line = f"{cfg} TP {tp} {pattern}: plan_pull {t_plan:.3f} ms ({plan.num_descriptors})"
            if pg is not None:
                idx = pg.plan(ids, ids)
                t_idx = median_ms(lambda pg=pg, ids=ids: pg.plan(ids, ids))
                line += (f", index plan {t_idx:.3f} ms ({idx.num_descriptors}, runs {idx.runs});"
                         f" tables {pg.num_rows} rows built in {build:.1f} ms")  # fmt: skip
            print(line)
        one = ids_for(m, "fragmented", rng, tokens=1)
        plan = descriptors.plan_pull(geo, one, one)
        t_one = median_ms(lambda geo=geo, ids=one: descriptors.plan_pull(geo, ids, ids))
        print(f"{cfg} TP {tp} one-block pull: plan_pull {t_one:.3f} ms "
              f"({plan.num_descriptors})")  # fmt: skip
    for cfg in ("granite-4.0-h-tiny", "qwen3-next-80b-a3b", "jamba-mini-1.5"):
        local = manifest(cfg, 1)
        ids = ids_for(local, "fragmented", rng)
        for tp in (2, 4, 8):
            try:
                geos = [descriptors.read_geometry(local, rank_manifest(cfg, tp, r))
                        for r in descriptors.source_ranks(local, tp)]  # fmt: skip
            except ManifestError as exc:
                print(f"{cfg} fan-in from TP {tp}: not shardable ({exc.reason})")
                continue
            fan = fan_in_geometry(geos)
            if fan is None:  # e.g. the planner picked another block size at this TP
                print(f"{cfg} fan-in from TP {tp}: the sides re-block (planned per rank)")
                continue
            one = median_ms(lambda geos=geos, ids=ids: [
                descriptors.plan_pull(g, ids, ids, local_checked=True) for g in geos])  # fmt: skip
            all_ = median_ms(lambda fan=fan, ids=ids: fan.plan(ids, ids, local_checked=True))
            print(f"{cfg} fan-in from TP {tp}: per rank {one:.3f} ms, all ranks at once "
                  f"{all_:.3f} ms ({one / all_:.1f}x)")  # fmt: skip


def rank_manifest(cfg: str, tp: int, rank: int):
    """A planned manifest of rank ``rank`` of ``tp``."""
    o = planner.PlanOptions(num_blocks=BLOCKS, tp_size=tp, tp_rank=rank)
    return planner.plan_manifest(presets.load_hf_config(cfg), o)


if __name__ == "__main__":
    main()
