#!/usr/bin/env python3
"""What a store lookup costs against the number of files in the store's subdirectories.

Entries live in ``root/<key[:2]>/``: a store of 1M entries has ~4k files per subdirectory. Two
measurements, each for every ``--files`` count (empty files with entry names of other keys,
padding the one subdirectory every key of the run falls in; the store measurement's own entries,
one per chunk, are there too):

- ``FileTier.writers`` of a (key, group) with one entry, and of one with none (the store's
  per-chunk lookup), steady (nothing changed since the last call) and after a sibling changed
  the subdirectory (a file added and removed before each call);
- the ceiling, taken in the same run: one ``os.listdir`` of the subdirectory (what every lookup
  cost before listings were reused), and ``hit/listdir``, the steady lookup as a share of it;
- ``Store.lookup`` and ``Store.load`` of a ``--tokens`` prompt in ``--chunk``-token chunks
  (a small dense layout: 2 layers, 1 KV head of 128; DRAM tier off, so every entry is read from
  its file and checked), by a store opened after the save.

Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_store_index.py`` (medians; µs for writers,
ms for lookup and load). Files go to a temp dir under ``--dir`` (default: the system's). Only
public calls: ``PYTHONPATH`` at another checkout measures that one's store.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile

from benchlib.timing import median_s

from kvxferd.layout import PlanOptions, plan_manifest, request_blocks
from kvxferd.layout.presets import load_hf_config
from kvxferd.pattern import write_pattern
from kvxferd.store import Store
from kvxferd.store.tiers import EntryId, FileTier

SUB = "ab"
"""The subdirectory every key of the run falls in (the padding's too)."""


def key() -> str:
    """A chunk key in SUB."""
    return SUB + secrets.token_hex(15)


def pad(root: str, count: int) -> None:
    """``count`` empty files with entry names (other keys, other groups) in SUB."""
    os.makedirs(os.path.join(root, SUB), exist_ok=True)
    for _ in range(count):
        eid = EntryId(key(), secrets.token_hex(8), 1, 0)
        with open(os.path.join(root, SUB, eid.filename), "wb"):
            pass


def bench_writers(root: str, count: int, n: int) -> dict[str, float]:
    pad(root, count)
    fp = secrets.token_hex(8)
    hit = EntryId(key(), fp, 1, 0)
    with open(os.path.join(root, SUB, hit.filename), "wb"):
        pass
    tier = FileTier(root, capacity=1 << 40)
    miss = key()
    out = {
        "listdir_us": median_s(lambda: os.listdir(os.path.join(root, SUB)), n, warmup=1) * 1e6,
        "hit_us": median_s(lambda: tier.writers(hit.key, fp), n, warmup=1) * 1e6,
        "miss_us": median_s(lambda: tier.writers(miss, fp), n, warmup=1) * 1e6,
    }
    churn = os.path.join(root, SUB, "churn")

    def changed() -> None:  # a sibling's write and eviction, then our lookup (untimed: below)
        with open(churn, "wb"):
            pass
        os.unlink(churn)

    after = median_s(lambda: tier.writers(hit.key, fp), n, before_each=changed)
    out["after_change_us"] = after * 1e6
    assert tier.writers(hit.key, fp) == [hit] and tier.writers(miss, fp) == []
    return out


def small_dense(tokens: int):  # noqa: ANN201
    hf = dict(load_hf_config("llama-3.1-8b"), num_hidden_layers=2, num_key_value_heads=1)
    probe = plan_manifest(hf, PlanOptions(num_blocks=1))
    return plan_manifest(hf, PlanOptions(num_blocks=sum(request_blocks(probe, tokens)) + 1))


def bench_store(root: str, count: int, tokens: int, chunk: int, n: int) -> dict[str, float]:
    import numpy as np

    m = small_dense(tokens)
    regions = [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]
    ids = [list(range(1, 1 + b)) for b in request_blocks(m, tokens)]
    write_pattern(m, regions, ids, 7)
    keys = [key() for _ in range(-(-tokens // chunk))]
    saver = Store(root, chunk, 0, 1 << 40)
    saver.save(m, regions, ids, keys, tokens)
    saver.close()
    pad(root, count)
    s = Store(root, chunk, 0, 1 << 40)
    try:
        assert s.lookup(m, keys, tokens).matched == tokens
        return {
            "lookup_ms": median_s(lambda: s.lookup(m, keys, tokens), n, warmup=1) * 1e3,
            "load_ms": median_s(lambda: s.load(m, regions, ids, keys, tokens), n, warmup=1) * 1e3,
        }
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="0,1000,4000,16000", help="padding files per subdir")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens (default 32768)")
    ap.add_argument("--chunk", type=int, default=64, help="store chunk tokens (default 64)")
    ap.add_argument("--repeat", type=int, default=5, help="timed lookups/loads, median")
    ap.add_argument("--calls", type=int, default=200, help="timed writers calls, median")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.files.split(",") if c]
    chunks = -(-args.tokens // args.chunk)
    print(f"{'pad/subdir':>12} {'listdir':>10} {'writers hit':>12} {'hit/listdir':>11} "
          f"{'miss':>8} {'after change':>13} {'lookup':>9} {'load':>9}   "
          f"({args.tokens} tokens, {chunks} chunks)")  # fmt: skip
    rows = []
    for count in counts:
        with tempfile.TemporaryDirectory(prefix="kvx-index-bench-", dir=args.dir) as tmp:
            w = bench_writers(os.path.join(tmp, "w"), count, args.calls)
            s = bench_store(os.path.join(tmp, "s"), count, args.tokens, args.chunk, args.repeat)
        row = {"files": count, **w, **s, "hit_vs_listdir": w["hit_us"] / w["listdir_us"]}
        rows.append(row)
        print(f"{count:>12} {w['listdir_us']:>7.1f} us {w['hit_us']:>9.1f} us "
              f"{row['hit_vs_listdir']:>11.3f} {w['miss_us']:>5.1f} us "
              f"{w['after_change_us']:>10.1f} us {s['lookup_ms']:>6.1f} ms "
              f"{s['load_ms']:>6.1f} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "chunk": args.chunk, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
