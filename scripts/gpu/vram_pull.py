#!/usr/bin/env python3
"""GPU check: two real ``kvxferd serve`` sidecars pull KV blocks between VRAM pools over NIXL.

What it checks (one GPU, cuda:0; a machine with torch+CUDA, nixl and kvxferd's dependencies):

1. This process plays both engines: it allocates a prefill and a decode KV pool in VRAM with
   torch (the small Mamba2 hybrid of ``benchlib.pullrig``, planned by kvxferd's planner, one
   tensor per manifest region), exports each with ``CudaIpcRegion`` and registers them with a
   prefill and a decode sidecar (``CudaRegionSpec`` sources, the engine API) as pullrig does
   for shared memory.
2. Prefill blocks hold ``kvxferd.pattern`` bytes (written on a host copy, then uploaded); the
   decode pool holds SENTINEL. A few small pulls (16 blocks each) land in *different*, mirrored
   decode block ids; then a large pull (``--large-blocks``, ~330 MB by default) is repeated
   ``--repeats`` times into shifted ids. After each, the decode pool is copied to the host and
   every byte of every layer of every pulled block must match the pattern, every other decode
   byte must still be SENTINEL, the pull must report exactly the planned bytes, and the hold
   must be released by the decode's notification.
3. First, ceilings for the large pull's bytes: a torch device-to-device copy, and a raw NIXL
   READ of one VRAM descriptor between two agents in two processes (verified, with the UCX
   lanes it took). Then what ``/readyz`` of each sidecar reports (the UCX transports READs
   used) and the large pull's GB/s (client round trip, and the sidecar's own duration).

The sidecars post every READ and prepared list with their regions' memory type and device
(``kvxferd.sidecar.peerviews.Memory``), and ``kvxferd serve`` turns UCX's memory-type cache off
(``UCX_MEMTYPE_CACHE=n``) so VRAM mapped through CUDA IPC registers: this script found both
missing on an H100 (2026-11-27).

Exit status: 0 only if the pulls verified; 1 otherwise; 2 (one line) when
torch.cuda is not available. ``--json PATH`` writes everything measured. ``--dram`` runs the
same flow over POSIX shared memory, without a GPU (to check this script itself).

Run from the repository root (kvxferd importable, e.g. ``PYTHONPATH=$PWD``)::

    python3 scripts/gpu/vram_pull.py --json /tmp/vram.json
    python3 scripts/gpu/vram_pull.py --dram --large-blocks 2000   # no GPU: the flow on shm
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _p in (str(HERE), str(HERE.parent), str(ROOT)):  # vram_ceilings, benchlib, kvxferd
    if _p not in sys.path:
        sys.path.insert(0, _p)

from vram_ceilings import ceilings, ucx_excerpt  # noqa: E402

PREFILL_BG = 0x3C
"""Prefill bytes outside the held blocks: a READ from the wrong place shows as neither the
pattern nor SENTINEL."""
SEED_SMALL, SEED_LARGE = 1000, 9000
PULL_DEADLINE_S = 20.0
RELEASE_TIMEOUT_S = 15.0


# ---------------------------------------------------------------------- pools (the engines)


class VramPool:
    """One engine rank's pool: a CUDA tensor per manifest region, exported by CUDA IPC."""

    def __init__(self, manifest: Any, fill: int) -> None:
        import torch

        from kvxferd.memory.cuda_ipc import CudaIpcRegion

        self.torch = torch
        self.manifest = manifest
        self.tensors = [torch.full((r.size_bytes,), fill, dtype=torch.uint8, device="cuda:0")
                        for r in manifest.regions]  # fmt: skip
        self.exports = [CudaIpcRegion.export(t, r.name)
                        for t, r in zip(self.tensors, manifest.regions, strict=True)]  # fmt: skip
        torch.cuda.synchronize()

    def specs(self) -> list[Any]:
        from kvxferd.wire import CudaRegionSpec

        return [CudaRegionSpec(handle=e.handle.to_bytes(), size_bytes=r.size_bytes,
                               device_id=r.device_id)
                for e, r in zip(self.exports, self.manifest.regions, strict=True)]  # fmt: skip

    def upload(self, host: list[Any]) -> None:
        for t, h in zip(self.tensors, host, strict=True):
            t.copy_(self.torch.from_numpy(h))
        self.torch.cuda.synchronize()

    def download(self) -> list[Any]:
        self.torch.cuda.synchronize()
        return [t.cpu().numpy() for t in self.tensors]

    def fill(self, value: int) -> None:
        for t in self.tensors:
            t.fill_(value)
        self.torch.cuda.synchronize()

    def close(self) -> None:
        for e in self.exports:
            e.close()
        self.tensors = []


class DramPool:
    """``--dram``: the same interface over benchlib's POSIX shared-memory pool."""

    def __init__(self, manifest: Any, fill: int) -> None:
        from benchlib.procs import Pool

        self.manifest = manifest
        self.pool = Pool(manifest)
        self.fill(fill)

    def specs(self) -> list[Any]:
        return self.pool.specs()

    def upload(self, host: list[Any]) -> None:
        for v, h in zip(self.pool.views, host, strict=True):
            v[:] = h

    def download(self) -> list[Any]:
        return self.pool.views

    def fill(self, value: int) -> None:
        for v in self.pool.views:
            v[:] = value

    def close(self) -> None:
        self.pool.close()


# ---------------------------------------------------------------------- block ids


def group_ids(m: Any, start: int, attn_blocks: int) -> tuple[list[list[int]], int]:
    """Consecutive ids from ``start``: one running state per Mamba group, ``attn_blocks`` per
    attention group; and the next free id."""
    ids = []
    for g in m.groups:
        n = 1 if g.kind == "mamba" else attn_blocks
        ids.append(list(range(start, start + n)))
        start += n
    return ids, start


def plan_ids(m: Any, small: int, large_attn: int) -> dict[str, Any]:
    """Prefill and decode ids of every pull, and the pool size they need.

    Prefill: small pulls from block 1 (pullrig's slots), then the large pull. Decode: the large
    pull shifted past the prefill's range, the small pulls mirrored (``N - id``: another place,
    and descending, so no two blocks coalesce) at the top of the pool.
    """
    from benchlib.pullrig import slot_ids

    small_p, used, small_tokens = slot_ids(m, small)
    large_p, end = group_ids(m, used, large_attn)
    span = end - used
    n = used + 2 * span + used
    large_d = [[i + span for i in g] for g in large_p]
    small_d = [[[n - i for i in g] for g in ids] for ids in small_p]
    block = min(g.block_size for g in m.groups if g.kind != "mamba")
    return {"num_blocks": n, "small": list(zip(small_p, small_d, strict=True)),
            "small_tokens": small_tokens, "large": (large_p, large_d),
            "large_tokens": large_attn * block}  # fmt: skip


def as_arrays(ids: list[list[int]]) -> list[Any]:
    import numpy as np

    return [np.asarray(g, dtype=np.int64) for g in ids]


def check_pool(dm: Any, views: list[Any], pulls: list[tuple[list[list[int]], int]]) -> list[str]:
    """Every pulled block holds its pattern; every other decode byte is still SENTINEL."""
    import numpy as np
    from benchlib.procs import SENTINEL

    from kvxferd import descriptors
    from kvxferd.pattern import verify_pattern

    problems = []
    masks = [np.zeros(r.size_bytes, dtype=bool) for r in dm.regions]
    for ids, seed in pulls:
        bad = verify_pattern(dm, views, ids, seed=seed)
        if bad is not None:
            problems.append(f"pull of seed {seed}: {bad}")
        own = as_arrays(ids)
        p = descriptors.plan_read(dm, dm, own, own)
        for r, off, n in zip(p.local_region.tolist(), p.local_offset.tolist(),
                             p.length.tolist(), strict=True):  # fmt: skip
            masks[r][off : off + n] = True
    for r, (view, mask) in enumerate(zip(views, masks, strict=True)):
        stray = view[: mask.size] != SENTINEL
        stray &= ~mask
        count = int(np.count_nonzero(stray))
        if count:
            at = int(np.argmax(stray))
            problems.append(f"region {r}: {count} bytes outside the pulled blocks changed "
                            f"(first at byte {at}: {int(view[at]):#04x})")  # fmt: skip
    return problems


# ---------------------------------------------------------------------- one phase


def readyz(peer: str) -> dict[str, Any]:
    import httpx

    try:
        resp = httpx.get(f"http://{peer}/readyz", timeout=10)
        return {"status": resp.status_code, "body": resp.json()}
    except Exception as exc:  # a report, not a failure of the check
        return {"error": repr(exc)}


def drain(side: Any, keep: int = 60) -> list[str]:
    """The sidecar's output lines so far (the last ``keep``)."""
    out = []
    while True:
        try:
            out.append(side.lines.get_nowait().rstrip())
        except queue.Empty:
            return out[-keep:]


def wait_released(client: Any, hold_ids: set[str], cursor: int) -> int:
    """Bounded: every hold of ``hold_ids`` released, each as ``notified``; the new cursor."""
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    want = set(hold_ids)
    while want:
        feed = client.released(cursor)
        cursor = feed.cursor
        for h in feed.holds:
            if h.hold_id in want:
                if h.reason != "notified":
                    raise RuntimeError(f"hold {h.hold_id} released {h.reason}, not notified")
                want.discard(h.hold_id)
        if want and time.monotonic() > deadline:
            raise RuntimeError(f"{len(want)} holds not released in {RELEASE_TIMEOUT_S} s")
        if want and not feed.holds:
            time.sleep(0.01)
    return cursor


def run_phase(name: str, pm: Any, dm: Any, ppool: Any, dpool: Any,
              ids: dict[str, Any], repeats: int, tmp: str) -> dict[str, Any]:  # fmt: skip
    """Start two sidecars, register, run the small and large pulls, verify, stop."""
    from benchlib.procs import SENTINEL, SidecarProcess
    from benchlib.pullrig import LEASE_S

    from kvxferd import descriptors
    from kvxferd.wire import HoldRequest, PullRequest

    out: dict[str, Any] = {"phase": name, "verified": False}
    try:
        sides = SidecarProcess.start_many(tmp, [f"{name}-prefill", f"{name}-decode"])
    except Exception as exc:
        out["error"] = f"sidecars did not start: {exc}"
        print(f"[{name}] FAILED: {out['error']}", flush=True)
        return out
    named = dict(zip(("prefill", "decode"), sides, strict=True))
    pc, dc = named["prefill"].client(), named["decode"].client()
    cursor = 0

    def pull(p_ids: list[list[int]], d_ids: list[list[int]], tokens: int, tag: str
             ) -> tuple[Any, float]:  # fmt: skip
        nonlocal cursor
        hold = HoldRequest(request_id=f"vram-{tag}-{uuid.uuid4().hex[:8]}", block_ids=p_ids,
                           num_tokens=tokens, lease_s=LEASE_S)  # fmt: skip
        ticket = pc.hold(hold)
        t0 = time.perf_counter()
        st = dc.run_pull(PullRequest(tickets=[ticket], block_ids=d_ids,
                                     deadline_s=PULL_DEADLINE_S))  # fmt: skip
        wall = time.perf_counter() - t0
        want = descriptors.plan_read(dm, pm, as_arrays(d_ids), as_arrays(p_ids)).total_bytes
        if st.state != "done":
            raise RuntimeError(f"{tag} pull ended {st.state}: {st.reason}: {st.detail}")
        if st.kv_bytes + st.state_bytes != want:
            raise RuntimeError(f"{tag} pull moved {st.kv_bytes + st.state_bytes} B, not {want}")
        cursor = wait_released(pc, {ticket.hold_id}, cursor)
        return st, wall

    try:
        pc.register(pm, ppool.specs())
        dc.register(dm, dpool.specs())
        out["readyz_after_register"] = {k: readyz(s.peer) for k, s in named.items()}
        small = []
        for k, (p_ids, d_ids) in enumerate(ids["small"]):
            st, wall = pull(p_ids, d_ids, ids["small_tokens"], f"small{k}")
            small.append({"bytes": st.kv_bytes + st.state_bytes, "descriptors": st.descriptors,
                          "wall_ms": wall * 1e3, "sidecar_ms": st.duration_s * 1e3})  # fmt: skip
        out["small_pulls"] = small
        problems = check_pool(
            dm, dpool.download(), [(d, SEED_SMALL + k) for k, (_p, d) in enumerate(ids["small"])]
        )
        out["small_problems"] = problems
        if problems:
            raise RuntimeError(f"small pulls moved wrong bytes: {problems[0]}")
        print(
            f"[{name}] {len(small)} small pulls verified "
            f"({small[0]['bytes']} B, {small[0]['descriptors']} descriptors each)",
            flush=True,
        )
        p_ids, d_ids = ids["large"]
        large = []
        for rep in range(repeats):
            dpool.fill(SENTINEL)
            st, wall = pull(p_ids, d_ids, ids["large_tokens"], f"large{rep}")
            problems = check_pool(dm, dpool.download(), [(d_ids, SEED_LARGE)])
            nbytes = st.kv_bytes + st.state_bytes
            row = {"bytes": nbytes, "descriptors": st.descriptors, "wall_s": wall,
                   "sidecar_s": st.duration_s, "gbps_wall": nbytes / wall / 1e9,
                   "gbps_sidecar": nbytes / max(st.duration_s, 1e-9) / 1e9,
                   "problems": problems}  # fmt: skip
            large.append(row)
            print(f"[{name}] large pull {rep}: {nbytes / 1e6:.1f} MB in {wall * 1e3:.1f} ms "
                  f"= {row['gbps_wall']:.2f} GB/s (sidecar {row['gbps_sidecar']:.2f} GB/s), "
                  f"{'verified' if not problems else problems[0]}", flush=True)  # fmt: skip
            if problems:
                raise RuntimeError(f"large pull moved wrong bytes: {problems[0]}")
        out["large_pulls"] = large
        out["large_best_gbps_wall"] = max(r["gbps_wall"] for r in large)
        out["large_best_gbps_sidecar"] = max(r["gbps_sidecar"] for r in large)
        out["verified"] = True
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {out['error']}", flush=True)
    finally:
        out["readyz"] = {k: readyz(s.peer) for k, s in named.items()}
        for k in named:
            print(f"[{name}] {k} /readyz: {json.dumps(out['readyz'][k])}", flush=True)
        out["sidecar_cmd"] = named["decode"].proc.args
        # serve's default --ucx-proto-log (read before the sidecars stop: they remove it)
        logs = {k: os.path.join(tempfile.gettempdir(), f"kvxferd-ucx-proto-{s.proc.pid}.log")
                for k, s in named.items()}  # fmt: skip
        out["ucx_proto_log"] = {k: ucx_excerpt(path) for k, path in logs.items()}
        pc.close()
        dc.close()
        out["sidecar_exit"] = {k: s.stop() for k, s in named.items()}
        out["sidecar_log"] = {k: drain(s) for k, s in named.items()}
        if not out["verified"]:
            for k, lines in out["sidecar_log"].items():
                for line in lines[-15:]:
                    print(f"[{name}] {k}| {line}", flush=True)
    return out


# ---------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="GPU check: real kvxferd sidecars pull KV blocks between VRAM pools "
        "(CUDA IPC regions) over NIXL; verified byte for byte, GB/s against a device-to-device "
        "copy and a raw NIXL READ. Exit 0: verified; 1: not; 2: no CUDA.",
        epilog="Run from the repository root with kvxferd importable (PYTHONPATH=$PWD). "
        "UCX_NET_DEVICES (default lo for the sidecars) and UCX_TLS pass through.",
    )
    ap.add_argument("--json", metavar="PATH", help="write the summary as JSON here")
    ap.add_argument("--small-pulls", type=int, default=4,
                    help="16-block pulls into mirrored decode ids (default 4)")  # fmt: skip
    ap.add_argument("--large-blocks", type=int, default=10000,
                    help="attention blocks of the large pull (default 10000: ~328 MB)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3,
                    help="times the large pull runs, each verified (default 3)")  # fmt: skip
    ap.add_argument("--no-raw", action="store_true", help="skip the raw NIXL READ ceiling")
    ap.add_argument(
        "--dram", action="store_true", help="no GPU: the flow over POSIX shm (no ceilings)"
    )
    args = ap.parse_args(argv)
    if min(args.small_pulls, args.large_blocks, args.repeats) < 1:
        ap.error("--small-pulls, --large-blocks and --repeats must be positive")
    return args


def cuda_problem() -> str:
    """Why there is no usable GPU ("" when torch sees one)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return "torch.cuda is not available (no GPU or no CUDA build of torch)"
    return ""


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2, default=str)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )  # the sidecars run ``-m kvxferd`` (or this file) and import kvxferd from here
    result: dict[str, Any] = {"verified": False, "mode": "dram" if args.dram else "vram",
                              "settings": vars(args)}  # fmt: skip
    if not args.dram and (why := cuda_problem()):
        print(f"vram_pull: {why}: nothing checked", file=sys.stderr)
        result["skipped"] = why
        write_json(args.json, result)
        return 2

    import msgspec
    import numpy as np
    from benchlib import pullrig, report
    from benchlib.procs import SENTINEL

    from kvxferd import descriptors
    from kvxferd.pattern import write_pattern

    result["machine"] = report.machine()
    result["env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    probe = pullrig.plan(1, 0, 4)
    ids = plan_ids(probe, args.small_pulls, args.large_blocks)
    manifests = [pullrig.plan(1, 0, ids["num_blocks"]) for _ in range(2)]
    if not args.dram:
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
        manifests = [msgspec.structs.replace(m, regions=[
            msgspec.structs.replace(r, mem="VRAM", device_id=0) for r in m.regions])
            for m in manifests]  # fmt: skip
    pm, dm = manifests
    pool_mb = sum(r.size_bytes for r in pm.regions) / 1e6
    print(
        f"vram_pull: {result['mode']} pools of {ids['num_blocks']} blocks ({pool_mb:.0f} MB "
        f"per side, {len(pm.regions)} regions), {result.get('gpu', 'no GPU')}",
        flush=True,
    )
    p_ids, d_ids = ids["large"]
    nbytes = descriptors.plan_read(dm, pm, as_arrays(d_ids), as_arrays(p_ids)).total_bytes
    result["phases"] = []
    with tempfile.TemporaryDirectory(prefix="kvx-vram-") as tmp:
        if not args.dram:  # first: what the hardware and NIXL alone do, whatever follows
            ceilings(result, nbytes, tmp, raw=not args.no_raw)
            write_json(args.json, result)
        Pool = DramPool if args.dram else VramPool
        ppool = dpool = None
        try:
            ppool, dpool = Pool(pm, PREFILL_BG), Pool(dm, SENTINEL)
            host = [np.full(r.size_bytes, PREFILL_BG, dtype=np.uint8) for r in pm.regions]
            for k, (small_p, _d) in enumerate(ids["small"]):
                write_pattern(pm, host, small_p, seed=SEED_SMALL + k)
            write_pattern(pm, host, p_ids, seed=SEED_LARGE)
            ppool.upload(host)
            del host
            dpool.fill(SENTINEL)
            result["phases"].append(run_phase("sidecars", pm, dm, ppool, dpool, ids,
                                              args.repeats, tmp))  # fmt: skip
            write_json(args.json, result)
        finally:
            for pool in (ppool, dpool):
                if pool is not None:
                    pool.close()
    ok = bool(result["phases"]) and all(ph["verified"] for ph in result["phases"])
    result["verified"] = ok
    d2d, raw = result.get("d2d", {}).get("gbps"), result.get("raw_nixl", {}).get("gbps")
    for ph in result["phases"]:
        best = ph.get("large_best_gbps_wall")
        vs = "".join(f", {best / c:.1%} of {k} ({c:.1f} GB/s)" for k, c in
                     (("D2D", d2d), ("raw NIXL", raw)) if best and c)  # fmt: skip
        print(f"verdict [{ph['phase']}]: {'verified' if ph['verified'] else 'NOT verified'}"
              + (f", large pull best {best:.2f} GB/s{vs}" if best else "")
              + (f" ({ph['error']})" if "error" in ph else ""), flush=True)  # fmt: skip
    write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
