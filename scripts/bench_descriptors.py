#!/usr/bin/env python3
"""Benchmark kvxferd's descriptor math against a straightforward per-block Python loop.

Measures, on a synthetic pooled hybrid (one attention group and one mamba2 group with a layer in
every region): building the descriptor tables of the whole pool (``build_views``), and mapping
one request (``plan_read``, coalesced and not, at equal and at mixed TP). The baseline is the
loop a first implementation would write: one descriptor per part (K, V, conv sections, SSM) per
layer per block unit. When the loop would take too long it runs on a subset of blocks and is
scaled linearly (the output says so). Results are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvxferd.descriptors import build_views, plan_read, read_geometry, reference_descriptor_count
from kvxferd.wire import AttentionLayer, Group, MambaLayer, Manifest, Part, Region

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when loaded by path
from benchlib.timing import median_s  # noqa: E402

FULL = {"regions": 60, "blocks": 100_000, "request": 1000, "repeat": 5}
QUICK = {"regions": 8, "blocks": 10_000, "request": 100, "repeat": 3}


def synthetic(regions: int, blocks: int, ratio: int, tp: int = 1, rank: int = 0) -> Manifest:
    """A pooled hybrid like vLLM lays one out: 8 KV heads x 128 (bf16) and mamba2 with 64 heads.

    The logical block holds as many tokens (a multiple of 16) as it takes for one attention page
    to hold the mamba state (padding the mamba page up to it); ``ratio`` kernel blocks make one.
    """
    heads = 8 // tp
    sec = [("conv_x", 64, 64 * 3 * 2), ("conv_b", 8, 128 * 3 * 2), ("conv_c", 8, 128 * 3 * 2)]
    conv = [(n, ut // tp if ut >= tp else 1, ub, ut) for n, ut, ub in sec]
    conv_bytes = sum(u * b for _n, u, b, _t in conv)
    ssm_unit, ssm_units = 64 * 128 * 4, 64 // tp
    mamba = conv_bytes + ssm_units * ssm_unit
    token = 2 * 8 * 128 * 2  # K and V bytes of one token at tp 1 (block size is TP-independent)
    step = 16 * ratio
    kernel = -(-mamba * tp // (token * step)) * step // ratio
    head_bytes = kernel * 128 * 2
    kv = heads * head_bytes
    kstride = 2 * kv
    page = ratio * kstride

    def part(name: str, off: int, stride: int, units: int, ub: int, ut: int) -> Part:
        return Part(
            name=name,
            offset=off,
            block_stride=stride,
            units=units,
            unit_bytes=ub,
            unit_stride=ub,
            units_total=ut,
        )

    attn, mam = [], []
    for i in range(regions):
        attn.append(
            AttentionLayer(
                name=f"a{i}",
                index=2 * i,
                region=i,
                num_kv_heads=heads,
                total_kv_heads=8,
                head_size=128,
                dtype="bfloat16",
                head_layout="HND",
                kv_order="blocks_first",
                k=part("k", 0, kstride, heads, head_bytes, 8),
                v=part("v", kv, kstride, heads, head_bytes, 8),
            )
        )
        offs = np.concatenate(([0], np.cumsum([u * b for _n, u, b, _t in conv])))
        mam.append(
            MambaLayer(
                name=f"m{i}",
                index=2 * i + 1,
                region=i,
                mamba_type="mamba2",
                conv_shape=[sum(u for _n, u, _b, _t in conv), 3],
                conv_dtype="bfloat16",
                ssm_shape=[ssm_units, 64, 128],
                ssm_dtype="float32",
                conv_layout="DS",
                conv=[
                    part(n, int(o), page, u, b, t)
                    for (n, u, b, t), o in zip(conv, offs, strict=False)
                ],
                ssm=part("ssm", conv_bytes, page, ssm_units, ssm_unit, 64),
            )
        )
    bs = kernel * ratio
    return Manifest(
        model="synthetic-hybrid",
        num_blocks=blocks,
        regions=[
            Region(name=f"r{i}", size_bytes=blocks * page, num_blocks=blocks, page_bytes=page)
            for i in range(regions)
        ],
        groups=[
            Group(kind="full_attention", block_size=bs, kernel_block_size=kernel, layers=attn),
            Group(kind="mamba", block_size=bs, kernel_block_size=bs, layers=mam),
        ],
        tp_size=tp,
        tp_rank=rank,
    )


def parts_of(layer) -> list[Part]:
    return [layer.k, layer.v] if isinstance(layer, AttentionLayer) else [*layer.conv, layer.ssm]


def loop_tables(m: Manifest, blocks: int) -> int:
    """Baseline: every part of every layer for the first ``blocks`` logical blocks, as tuples."""
    out = []
    for group in m.groups:
        ratio = 1 if group.kind == "mamba" else group.block_size // group.kernel_block_size
        for layer in group.layers:
            for p in parts_of(layer):
                n = p.units * p.unit_bytes
                for u in range(blocks * ratio):
                    out.append((layer.region, p.offset + u * p.block_stride, n))
    return len(out)


def loop_plan(local: Manifest, remote: Manifest, lids, rids) -> int:
    """Baseline: equal-TP request mapping, one descriptor pair per part per block unit."""
    out = []
    for g, group in enumerate(local.groups):
        ratio = 1 if group.kind == "mamba" else group.block_size // group.kernel_block_size
        for ll, rl in zip(group.layers, remote.groups[g].layers, strict=True):
            for lp, rp in zip(parts_of(ll), parts_of(rl), strict=True):
                n = lp.units * lp.unit_bytes
                for a, b in zip(lids[g].tolist(), rids[g].tolist(), strict=True):
                    for j in range(ratio):
                        out.append(
                            (
                                ll.region,
                                lp.offset + (a * ratio + j) * lp.block_stride,
                                rl.region,
                                rp.offset + (b * ratio + j) * rp.block_stride,
                                n,
                            )
                        )
    return len(out)


def request(m: Manifest, n: int, scattered: bool, seed: int = 0) -> list[np.ndarray]:
    """``n`` ids per group, disjoint across groups: a contiguous run, or a random sample."""
    if scattered:
        ids = np.random.default_rng(seed).permutation(m.num_blocks)[: 2 * n]
    else:
        ids = np.arange(1, 2 * n + 1)
    return [ids[:n].astype(np.int64), ids[n : 2 * n].astype(np.int64)]


def row(case: str, ours: float, loop: float | None, descs: int, loop_descs: int | None,
        scaled: bool = False) -> dict:  # fmt: skip
    """One result line: seconds and descriptor counts, ours against the loop baseline."""
    return dict(case=case, ours_s=ours, loop_s=loop, loop_scaled=scaled, descriptors=descs,
                loop_descriptors=loop_descs)  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    m = synthetic(args.regions, args.blocks, args.ratio)
    views = build_views(m)
    t_views = median_s(lambda: build_views(m), args.repeat)
    per_block = sum(len(parts_of(layer)) for g in m.groups for layer in g.layers) * args.ratio
    sub = max(1, min(args.blocks, int(200_000 // per_block)))  # ~0.2M tuples per loop run
    t_loop = median_s(lambda: loop_tables(m, sub), 1) * args.blocks / sub
    rows = [row("build_views (whole pool)", t_views, t_loop, views.num_descriptors,
                per_block * args.blocks, scaled=sub < args.blocks)]  # fmt: skip
    geo = read_geometry(m, m)
    for tag in ("contiguous", "scattered"):
        lids = request(m, args.request, tag == "scattered", 1)
        rids = request(m, args.request, tag == "scattered", 2)
        ref = reference_descriptor_count(m, lids)
        t_base = median_s(lambda a=lids, b=rids: loop_plan(m, m, a, b), 3)
        for co in (False, True):
            n = plan_read(m, m, lids, rids, coalesce=co).num_descriptors
            t = median_s(
                lambda c=co, a=lids, b=rids: plan_read(m, m, a, b, coalesce=c), args.repeat
            )
            rows.append(row(f"plan_read {tag} coalesce={co}", t, t_base, n, ref))
            t = median_s(lambda c=co, a=lids, b=rids: geo.plan(a, b, coalesce=c), args.repeat)
            rows.append(row("  same, peer geometry cached", t, t_base, n, ref))
    local = synthetic(args.regions, args.blocks, args.ratio, tp=2, rank=1)
    lids = request(m, args.request, False, 1)
    t = median_s(lambda: plan_read(local, m, lids, lids), args.repeat)
    n = plan_read(local, m, lids, lids).num_descriptors
    rows.append(row("plan_read tp2<-tp1 contiguous", t, None, n, None))
    t = median_s(lambda: read_geometry(m, m), args.repeat)
    rows.append(row("read_geometry (per peer, once)", t, None, 0, None))
    return dict(regions=args.regions, blocks=args.blocks, ratio=args.ratio,
                request_blocks=args.request, repeat=args.repeat, rows=rows)  # fmt: skip


def show(result: dict) -> None:
    print(
        f"pool: {result['regions']} regions x {result['blocks']} logical blocks, kernel ratio "
        f"{result['ratio']}; request: {result['request_blocks']} blocks per group (2 groups)"
    )
    head = ("case", "ours ms", "loop ms", "speedup", "descs", "loop descs")
    print(f"{head[0]:40} {head[1]:>10} {head[2]:>10} {head[3]:>9} {head[4]:>10} {head[5]:>11}")
    for r in result["rows"]:
        loop = (
            "-"
            if r["loop_s"] is None
            else f"{r['loop_s'] * 1e3:.1f}" + ("*" if r["loop_scaled"] else "")
        )
        ratio = "-" if r["loop_s"] is None else f"{r['loop_s'] / r['ours_s']:.1f}x"
        ld = "-" if r["loop_descriptors"] is None else str(r["loop_descriptors"])
        print(
            f"{r['case']:40} {r['ours_s'] * 1e3:10.2f} {loop:>10} {ratio:>9} "
            f"{r['descriptors']:>10} {ld:>11}"
        )
    if any(r["loop_scaled"] for r in result["rows"]):
        print("* loop timed on a subset of blocks and scaled linearly to the whole pool")
    print("loop descs: vLLM-style count (one descriptor per part per layer per block unit)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regions", type=int, help="pooled regions (default 60, quick 8)")
    ap.add_argument("--blocks", type=int, help="logical blocks (default 100000, quick 10000)")
    ap.add_argument("--ratio", type=int, default=1, help="kernel blocks per logical block")
    ap.add_argument("--request", type=int, help="blocks per group (default 1000, quick 100)")
    ap.add_argument("--repeat", type=int, help="timed repetitions, median (default 5, quick 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    result = run(args)
    show(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
