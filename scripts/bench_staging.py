#!/usr/bin/env python3
"""Prefill fan-in: the direct READ of many strided descriptors against whole-run READs into a
staging buffer and a local scatter of the same bytes.

A decode rank (TP 1, this process, NIXL busy-polled as the sidecar runs it) pulls the bench
model's 16-block slots (``benchlib.pullrig``) from a pod sidecar serving prefill TP 8 (``serve
--pod-ranks 8``) and, for reference, from a TP 1 prefill sidecar. Per pull, interleaved:

- ``direct``: one READ of every rank's coalesced plan, joined (what a pod pull posts today);
- ``staged``: one READ of each prefill rank's run of blocks whole per region (few, large
  descriptors) into a registered staging buffer, then the planned descriptors copied from it
  into the decode blocks (kvxferd.descriptors.staging: its ``stage_plans`` and ``scatter``, as
  the sidecar stages a READ);
- ``tp1``: one READ of the same bytes from one prefill rank (the fan-in target's baseline).

Each timed pull includes building its descriptor tables from the plans (planning itself is the
same for all and not timed). The first pull of each batch scrubs the decode pool and verifies
every byte afterwards. Prints wall and CPU time per pull (this process, all threads: over CMA
the reader does the copy) and the ratios staged / direct and direct / tp1. READs carry no
notification: the prefill sidecars hold no blocks here, so nothing would poll for it.

Run: ``PYTHONPATH=$PWD UCX_NET_DEVICES=lo .venv/bin/python scripts/bench_staging.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402
from benchlib.faults.peerauth import peer_headers  # noqa: E402
from benchlib.procs import SENTINEL, TOKEN, Pool, SidecarProcess  # noqa: E402
from benchlib.pullrig import SEED0, Rank, plan, slot_ids  # noqa: E402

from kvxferd import descriptors  # noqa: E402
from kvxferd.memory import SharedMemoryRegion  # noqa: E402
from kvxferd.pattern import verify_pattern, write_pattern  # noqa: E402
from kvxferd.transport import Agent  # noqa: E402
from kvxferd.wire import PROTOCOL_VERSION, Handshake, Manifest  # noqa: E402

NOTIF = b""


@dataclass
class Source:
    """A prefill engine as the reader sees it: remote agent, per-rank manifests and bases."""

    remote: str
    manifests: list[Manifest]
    bases: list[np.ndarray]


def handshake(agent: Agent, name: str, dm: Manifest, dbases: np.ndarray, peer: str) -> Source:
    mine = Handshake(protocol_version=PROTOCOL_VERSION, engine_id=name, epoch=1,
                     agent_name=name, agent_metadata=agent.get_agent_metadata(), manifest=dm,
                     region_bases=[int(b) for b in dbases])  # fmt: skip
    body = msgspec.json.encode(mine)
    headers = {**peer_headers("POST", "/v1/handshake", body, TOKEN),
               "Content-Type": "application/json"}  # fmt: skip
    resp = httpx.post(f"http://{peer}/v1/handshake", content=body, timeout=60, headers=headers)
    resp.raise_for_status()
    theirs = msgspec.json.decode(resp.content, type=Handshake)
    remote = agent.add_remote(theirs.agent_metadata)
    manifests = [theirs.manifest] + [p.manifest for p in theirs.pod]
    bases = [np.asarray(theirs.region_bases, dtype=np.int64)]
    bases += [np.asarray(p.region_bases, dtype=np.int64) for p in theirs.pod]
    return Source(remote, manifests, bases)


@dataclass
class SlotPlan:
    """One slot's pull from one source: every rank's coalesced plan."""

    rank: np.ndarray
    plan: descriptors.ReadPlan
    plans: list[descriptors.ReadPlan]


def slot_plan(dm: Manifest, src: Source, ids: list[list[int]]) -> SlotPlan:
    own = [np.asarray(g, dtype=np.int64) for g in ids]
    plans = [descriptors.plan_read(dm, m, own, own) for m in src.manifests]
    rank = np.repeat(np.arange(len(plans)), [len(p.length) for p in plans])
    fields = ("local_region", "local_offset", "remote_region", "remote_offset", "length")
    cat = [np.concatenate([getattr(p, f) for p in plans]) for f in fields]
    total = sum(p.total_bytes for p in plans)
    return SlotPlan(rank, descriptors.ReadPlan(*cat, total, 0), plans)


class Reader:
    """The decode rank: its pool and a staging buffer, registered with one NIXL agent."""

    def __init__(self, dm: Manifest, staging_bytes: int) -> None:
        self.name = f"stg-{uuid.uuid4().hex[:8]}"
        self.pool = Pool(dm)
        self.stage = SharedMemoryRegion.create(f"kvxferd-{self.name}-stage", staging_bytes)
        self.stage_view = self.stage.host_view()
        self.agent = Agent(self.name, progress_thread=False)
        self.agent.register(self.pool.segments)
        self.agent.register(self.stage)
        self.manifest = dm

    def close(self) -> None:
        self.agent.close()
        self.stage.close()
        self.pool.close()

    def direct(self, src: Source, sp: SlotPlan) -> None:
        p = sp.plan
        local = self.pool.bases[p.local_region] + p.local_offset
        remote = _remote_bases(src, sp) + p.remote_offset
        with self.agent.read(src.remote, (local, p.length), (remote, p.length), NOTIF) as x:
            x.wait(60.0)

    def staged(self, src: Source, sp: SlotPlan, stage_at: int, copy: bool = True) -> None:
        """kvxferd's staged form (kvxferd.descriptors.staging): its runs READ into the staging
        buffer at ``stage_at``, then its scatter (``copy``)."""
        st = descriptors.stage_plans(sp.plans, [len(b) for b in src.bases], min_descriptors=1,
                                     max_bytes=1 << 40)  # fmt: skip
        assert st is not None
        remote = np.concatenate(src.bases)[st.run_key] + st.run_offset
        local = self.stage.base_addr + stage_at + st.run_at
        with self.agent.read(src.remote, (local, st.run_length), (remote, st.run_length),
                             NOTIF) as x:  # fmt: skip
            x.wait(60.0)
        if copy:
            descriptors.scatter(self.stage_view[stage_at : stage_at + st.nbytes],
                                self.pool.views, st)  # fmt: skip


def _remote_bases(src: Source, sp: SlotPlan) -> np.ndarray:
    table = np.stack([np.pad(b, (0, 64 - len(b))) for b in src.bases])
    return table[sp.rank, sp.plan.remote_region]


def staging_bytes(sp: SlotPlan, src: Source) -> int:
    st = descriptors.stage_plans(sp.plans, [len(b) for b in src.bases], min_descriptors=1,
                                 max_bytes=1 << 40)  # fmt: skip
    assert st is not None
    return st.nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8, help="prefill TP of the pod (default 8)")
    ap.add_argument("--slots", type=int, default=16, help="slots cycled (default 16, as 16 in "
                    "flight in bench_pulls)")  # fmt: skip
    ap.add_argument("--batch", type=int, default=200, help="pulls per timed batch")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved batches of each kind")
    ap.add_argument("--scale", type=int, default=1, help="head sizes times this (rows and "
                    "bytes per pull grow with it; default 1: ~0.5 MB per pull)")  # fmt: skip
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    probe = plan(1, 0, 4, args.scale)
    ids, num_blocks, _ = slot_ids(probe, args.slots)
    dm = plan(1, 0, num_blocks, args.scale)
    engines = {"tp1": 1, "pod": args.tp}
    manifests = {k: [plan(tp, r, num_blocks, args.scale) for r in range(tp)]
                 for k, tp in engines.items()}  # fmt: skip
    pools = {k: [Pool(m) for m in ms] for k, ms in manifests.items()}
    for ps in pools.values():
        for p in ps:
            for s, slot in enumerate(ids):
                write_pattern(p.manifest, p.views, slot, seed=SEED0 + s)
    with tempfile.TemporaryDirectory(prefix="kvx-stg-") as tmp:
        (one,) = SidecarProcess.start_many(tmp, ["prefill-tp1"])
        (pod,) = SidecarProcess.start_many(tmp, [f"prefill-pod{args.tp}"],
                                           args=["--pod-ranks", str(args.tp)])  # fmt: skip
        reader = None
        try:
            Rank(one, manifests["tp1"][0], pools["tp1"][0]).register()
            with ThreadPoolExecutor(args.tp) as ex:
                list(
                    ex.map(
                        Rank.register,
                        [
                            Rank(pod, m, p)
                            for m, p in zip(manifests["pod"], pools["pod"], strict=True)
                        ],
                    )
                )
            probe_src = Source("", manifests["pod"], [p.bases for p in pools["pod"]])
            per_slot = staging_bytes(slot_plan(dm, probe_src, ids[0]), probe_src)
            reader = Reader(dm, per_slot * args.slots)
            srcs = {
                "tp1": handshake(reader.agent, reader.name, dm, reader.pool.bases, one.peer),
                "pod": handshake(reader.agent, reader.name, dm, reader.pool.bases, pod.peer),
            }
            plans = {k: [slot_plan(dm, s, slot) for slot in ids] for k, s in srcs.items()}
            kinds = {
                "direct": lambda i: reader.direct(srcs["pod"], plans["pod"][i]),
                "staged": lambda i: reader.staged(srcs["pod"], plans["pod"][i], i * per_slot),
                "stage_read_only": lambda i: reader.staged(
                    srcs["pod"], plans["pod"][i], i * per_slot, copy=False
                ),
                "tp1": lambda i: reader.direct(srcs["tp1"], plans["tp1"][i]),
            }
            wall: dict[str, list[float]] = {k: [] for k in kinds}
            cpu: dict[str, list[float]] = {k: [] for k in kinds}
            verified = 0
            for rnd in range(args.rounds + 1):  # round 0: warm-up, not reported
                for kind, fn in kinds.items():
                    slot = rnd % args.slots
                    reader.pool.views[0][:] = SENTINEL
                    reader.pool.views[1][:] = SENTINEL
                    fn(slot)
                    bad = verify_pattern(dm, reader.pool.views, ids[slot], seed=SEED0 + slot)
                    if bad is not None and kind != "stage_read_only":
                        raise SystemExit(f"{kind}: wrong bytes in slot {slot}: {bad}")
                    verified += 1
                    c0, t0 = time.process_time(), time.perf_counter()
                    for i in range(args.batch):
                        fn(i % args.slots)
                    if rnd:
                        wall[kind].append((time.perf_counter() - t0) / args.batch * 1e6)
                        cpu[kind].append((time.process_time() - c0) / args.batch * 1e6)
        finally:
            if reader is not None:
                reader.close()
            one.stop()
            pod.stop()
            for ps in pools.values():
                for p in ps:
                    p.close()
    descs = {"direct": len(plans["pod"][0].plan.length), "tp1": len(plans["tp1"][0].plan.length)}
    st = descriptors.stage_plans(plans["pod"][0].plans, [len(b) for b in srcs["pod"].bases],
                                 min_descriptors=1, max_bytes=1 << 40)  # fmt: skip
    assert st is not None
    result = {
        "tp": args.tp, "scale": args.scale, "slots": args.slots, "batch": args.batch,
        "rounds": args.rounds,
        "bytes_per_pull": int(plans["pod"][0].plan.kv_bytes),
        "staging_bytes_per_pull": per_slot,
        "descriptors": {**descs, "staged_read": st.num_runs, "staged_copies": len(st.copies)},
        "wall_us": {k: statistics.median(v) for k, v in wall.items()},
        "cpu_us": {k: statistics.median(v) for k, v in cpu.items()},
        "wall_us_rounds": {k: [round(x, 1) for x in v] for k, v in wall.items()},
        "staged_over_direct_by_round": [round(s / d, 3) for s, d in
                                        zip(wall["staged"], wall["direct"], strict=True)],
        "verified_pulls": verified,
        "load_average": [load0, os.getloadavg()],
    }  # fmt: skip
    w, c = result["wall_us"], result["cpu_us"]
    print(f"prefill TP {args.tp} pod -> decode TP 1, {result['bytes_per_pull']} B per pull, "
          f"{args.rounds} x {args.batch} pulls per kind, interleaved")  # fmt: skip
    print(f"descriptors: direct {descs['direct']}, staged {st.num_runs} READ + "
          f"{len(st.copies)} copies, TP 1 {descs['tp1']}")  # fmt: skip
    for k in kinds:
        print(f"{k:>7}: {w[k]:7.1f} us wall, {c[k]:7.1f} us CPU per pull (medians of rounds)")
    print(f"staged / direct: wall {w['staged'] / w['direct']:.2f}, "
          f"CPU {c['staged'] / c['direct']:.2f}; direct / tp1: wall {w['direct'] / w['tp1']:.2f}; "
          f"staged / tp1: wall {w['staged'] / w['tp1']:.2f}")  # fmt: skip
    print(f"per round staged/direct: {result['staged_over_direct_by_round']}")
    print(f"load average {result['load_average']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
