#!/usr/bin/env python3
"""Benchmark the store's save and load against the file-I/O ceiling and memcpy.

For each layout (planner-made pools, pattern-filled) and request size, in the same run and over
the same bytes (the canonical payload: every KV row and Mamba state of the request):

- file tier: ``Store.save`` into an empty directory with the DRAM pool off (gather into the
  canonical order, CRC32 per section, temp file + rename, no fsync), and ``Store.load`` by a
  new store (empty DRAM pool: read, check every checksum, scatter into the blocks);
- ceiling: one ``os.write`` of a buffer of the same byte count into a new file (no fsync), and
  one ``readinto`` of that file; both through the page cache like the store (hot, no direct I/O);
- DRAM tier: save with the files off, and load from the DRAM pool; against ``np.copyto`` of the
  same byte count (one thread), the memcpy ceiling;
- every store of the run shares one warm buffer pool (a long-running sidecar's steady state):
  entries reuse buffers instead of faulting fresh pages in;
- crc32: ``zlib.crc32`` over the same bytes (the checksum share of save and load).

The first load of each tier is verified (kvxferd.pattern) before any time is taken; the target
blocks are poisoned first (``kvxferd.sim.storecache.poison``), so only a complete load passes. GB/s
are 1e9 B/s, medians of ``--repeat`` runs after ``--warmup`` runs. In-process: what the sidecar
adds (one HTTP call per request, a worker thread) is not in these numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from benchlib import cli, report  # noqa: E402

from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest, request_blocks  # noqa: E402
from kvxferd.pattern import verify_token_pattern, write_token_pattern  # noqa: E402
from kvxferd.sim.storecache import poison  # noqa: E402
from kvxferd.store import Store, chunk_keys  # noqa: E402
from kvxferd.store.pool import BufferPool  # noqa: E402
from kvxferd.wire import Manifest  # noqa: E402

LAYOUTS = {
    "dense": ("llama-3.1-8b", {}),
    "mamba2-hybrid": ("granite-4.0-h-tiny", {}),
    "gdn-hybrid": ("qwen3-next-80b-a3b", {}),
}
FULL = {"layouts": "dense,mamba2-hybrid,gdn-hybrid", "tokens": "1024,4096", "repeat": 5,
        "warmup": 1, "chunk": 256}  # fmt: skip
QUICK = {"layouts": "mamba2-hybrid", "tokens": "1024", "repeat": 2, "warmup": 1, "chunk": 256}
SEED = 2024
BIG = 1 << 40
POOL = BufferPool(free_limit=4 << 30)
"""One warm buffer pool for every store of the run, as in a long-running sidecar (a cold pool
pays a page fault per 4 KiB of each new entry; see kvxferd.store.pool)."""


class BenchError(RuntimeError):
    """The benchmark cannot report a number (a load moved wrong bytes)."""


def _median_gbps(nbytes: int, fn: Callable[[], None], setup: Callable[[], None], args) -> float:  # noqa: ANN001
    times = []
    for i in range(args.warmup + args.repeat):
        setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
    return nbytes / statistics.median(times) / 1e9


def _request(m: Manifest, tokens: int) -> list[list[int]]:
    """Scattered block ids (every other block, from the top) per group."""
    out, nxt = [], m.num_blocks - 1
    for n in request_blocks(m, tokens):
        out.append(list(range(nxt, nxt - 2 * n, -2)))
        nxt -= 2 * n
    return out


def run_case(name: str, tokens: int, args, root: str) -> dict:  # noqa: ANN001
    model, opts = LAYOUTS[name]
    hf = load_hf_config(model)
    probe = plan_manifest(hf, PlanOptions(num_blocks=1, **opts))
    blocks = 2 * sum(request_blocks(probe, tokens)) + 2
    m = plan_manifest(hf, PlanOptions(num_blocks=blocks, **opts))
    src = [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]
    dst = [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]
    ids = _request(m, tokens)
    write_token_pattern(m, src, ids, tokens, SEED)
    keys = chunk_keys(list(range(tokens)), args.chunk, name.encode())
    files_dir = os.path.join(root, f"{name}-{tokens}")
    state: dict = {}

    def fresh_dir() -> None:
        shutil.rmtree(files_dir, ignore_errors=True)
        state["store"] = Store(files_dir, args.chunk, 0, BIG, pool=POOL)

    def save() -> None:
        state["saved"] = state["store"].save(m, src, ids, keys, tokens)

    fresh_dir()
    save()
    payload = state["saved"].kv_bytes + state["saved"].state_bytes
    entry_bytes = state["saved"].file_bytes
    save_file = _median_gbps(payload, save, fresh_dir, args)

    def reopen() -> None:
        state["store"] = Store(files_dir, args.chunk, 0, BIG, pool=POOL)
        poison(m, dst, ids, SEED, tokens)

    def load() -> None:
        state["store"].load(m, dst, ids, keys, tokens)

    reopen()
    load()
    if verify_token_pattern(m, dst, ids, tokens, SEED) is not None:
        raise BenchError(f"{name} {tokens}: the file tier loaded wrong bytes")
    load_file = _median_gbps(payload, load, reopen, args)

    state["store"] = Store(os.path.join(root, "unused"), args.chunk, BIG, 0, pool=POOL)
    save()
    save_dram = _median_gbps(payload, save, state["store"].dram.clear, args)
    poison(m, dst, ids, SEED, tokens)
    load()
    if verify_token_pattern(m, dst, ids, tokens, SEED) is not None:
        raise BenchError(f"{name} {tokens}: the DRAM tier loaded wrong bytes")
    load_dram = _median_gbps(payload, load, lambda: None, args)

    buf = np.random.default_rng(0).integers(0, 255, payload, dtype=np.uint8)
    out = np.empty_like(buf)
    path = os.path.join(root, "ceiling.bin")

    def write_file() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(buf)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def unlink() -> None:
        if os.path.exists(path):
            os.unlink(path)

    def read_file() -> None:
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(out), 0
            while got < payload:
                got += f.readinto(view[got:]) or payload

    file_write = _median_gbps(payload, write_file, unlink, args)
    write_file()
    file_read = _median_gbps(payload, read_file, lambda: None, args)
    unlink()
    memcpy = _median_gbps(payload, lambda: np.copyto(out, buf), lambda: None, args)
    crc = _median_gbps(payload, lambda: zlib.crc32(buf), lambda: None, args)
    shutil.rmtree(files_dir, ignore_errors=True)
    case = {
        "layout": name, "model": model, "tokens": tokens, "chunk_tokens": args.chunk,
        "payload_bytes": payload, "entry_bytes": entry_bytes,
        "kv_bytes": state["saved"].kv_bytes, "state_bytes": state["saved"].state_bytes,
        "entries": state["saved"].chunks_saved,
        "save_file_gbps": save_file, "load_file_gbps": load_file,
        "file_write_gbps": file_write, "file_read_gbps": file_read,
        "save_dram_gbps": save_dram, "load_dram_gbps": load_dram,
        "memcpy_gbps": memcpy, "crc32_gbps": crc,
        "save_file_vs_ceiling": save_file / file_write,
        "load_file_vs_ceiling": load_file / file_read,
        "save_dram_vs_memcpy": save_dram / memcpy, "load_dram_vs_memcpy": load_dram / memcpy,
        "verified": True,
    }  # fmt: skip
    print(f"{name:14} {tokens:>6} {payload / 1e6:8.1f} MB  file save {save_file:5.2f} "
          f"load {load_file:5.2f} (ceil w {file_write:5.2f} r {file_read:5.2f})  dram save "
          f"{save_dram:5.2f} load {load_dram:5.2f} (memcpy {memcpy:5.2f})  crc32 {crc:5.2f}",
          flush=True)  # fmt: skip
    return case


def table(result: dict) -> str:
    """The per-case table with the ratios against the ceilings."""
    head = (f"{'layout':14} {'tokens':>6} {'MB':>7} {'save-f':>6} {'wr-ceil':>7} {'ratio':>5} "
            f"{'load-f':>6} {'rd-ceil':>7} {'ratio':>5} {'save-d':>6} {'load-d':>6} "
            f"{'memcpy':>6} {'sd/mc':>5} {'ld/mc':>5} {'crc32':>6}")  # fmt: skip
    rows = [head]
    for c in result["cases"]:
        rows.append(
            f"{c['layout']:14} {c['tokens']:>6} {c['payload_bytes'] / 1e6:7.1f} "
            f"{c['save_file_gbps']:6.2f} {c['file_write_gbps']:7.2f} "
            f"{c['save_file_vs_ceiling']:5.2f} {c['load_file_gbps']:6.2f} "
            f"{c['file_read_gbps']:7.2f} {c['load_file_vs_ceiling']:5.2f} "
            f"{c['save_dram_gbps']:6.2f} {c['load_dram_gbps']:6.2f} {c['memcpy_gbps']:6.2f} "
            f"{c['save_dram_vs_memcpy']:5.2f} {c['load_dram_vs_memcpy']:5.2f} "
            f"{c['crc32_gbps']:6.2f}"
        )
    rows.append("GB/s medians over the canonical payload. save-f/load-f: file tier (DRAM off); "
                "wr-ceil/rd-ceil: one os.write / readinto of as many bytes (page cache, no "
                "fsync); save-d/load-d: DRAM tier; memcpy: np.copyto, one thread.")  # fmt: skip
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    """Bars per case: store save/load vs their ceilings, file and DRAM tiers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    keys = [("save_file_gbps", "file save"), ("file_write_gbps", "write ceiling"),
            ("load_file_gbps", "file load"), ("file_read_gbps", "read ceiling"),
            ("save_dram_gbps", "DRAM save"), ("load_dram_gbps", "DRAM load"),
            ("memcpy_gbps", "memcpy")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    width = 0.8 / len(keys)
    xs = np.arange(len(cases))
    for i, (key, label) in enumerate(keys):
        ax.bar(xs + i * width, [c[key] for c in cases], width, label=label)
    ax.set_xticks(xs + 0.4 - width / 2, [f"{c['layout']}\n{c['tokens']} tok" for c in cases])
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvxferd store vs ceilings ({result['machine']['cpu_count']} CPUs)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (seconds)")
    ap.add_argument("--layouts", help=f"comma list of {sorted(LAYOUTS)}")
    ap.add_argument("--tokens", help="comma list of request sizes in tokens")
    ap.add_argument("--repeat", type=int, help="timed runs per measurement, median (default 5)")
    ap.add_argument("--warmup", type=int, help="untimed runs before each measurement (1)")
    ap.add_argument("--chunk", type=int, help="store chunk tokens (default 256)")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PATH.png", help="draw the bars")
    args = ap.parse_args(argv)
    cli.fill_defaults(args, QUICK, FULL)
    layouts = cli.names(ap, "--layouts", args.layouts, LAYOUTS)
    tokens = sorted(int(t) for t in args.tokens.split(",") if t)
    if args.repeat < 1 or args.warmup < 0 or not tokens or min(tokens) < 1 or args.chunk < 1:
        ap.error("--repeat >= 1, --warmup >= 0, --tokens and --chunk positive")
    started = time.monotonic()
    result = {
        "machine": report.machine(),
        "settings": {"layouts": {n: {"model": LAYOUTS[n][0], "options": LAYOUTS[n][1]}
                                 for n in layouts},
                     "tokens": tokens, "repeat": args.repeat, "warmup": args.warmup,
                     "chunk_tokens": args.chunk, "quick": args.quick},
        "cases": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvx-store-bench-", dir=args.dir) as tmp:
        for name in layouts:
            for t in tokens:
                result["cases"].append(run_case(name, t, args, tmp))
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    print()
    print(table(result))
    cli.write_outputs(result, args.json, args.plot, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
