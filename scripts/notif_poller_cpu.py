"""CPU a prefill sidecar spends polling NIXL notifications: idle, and with a hold claimed.

Starts one ``kvxferd serve`` (progress thread off, as in production), registers a small pool,
and reads the child's CPU time (utime + stime from /proc) over windows:

- ``idle``: registered, no hold;
- ``claimed_first_s``: the first second after a claim whose reader never reads;
- ``claimed_steady``: a later window with that hold still claimed.

Prints one JSON object with the share of one core per window. Compare two checkouts by running
it with each one first on PYTHONPATH. A claim is made directly on the peer API.

    PYTHONPATH=$PWD UCX_NET_DEVICES=lo python scripts/notif_poller_cpu.py --window 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import httpx
import msgspec
from benchlib.faults.peerauth import peer_headers

from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.sim.kvpool import RankPool
from kvxferd.sim.sidecars import start_sidecars
from kvxferd.wire import ClaimRequest, HoldRequest

TOKEN = "cpu-probe-secret"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share(pid: int, seconds: float) -> float:
    """Share of one core ``pid`` used over the next ``seconds``."""
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=5.0, help="seconds per steady window")
    args = ap.parse_args(argv)
    env = {**os.environ, "KVXFERD_PROGRESS_THREAD": "false", "UCX_NET_DEVICES": "lo"}
    with tempfile.TemporaryDirectory() as tmp:
        [s] = start_sidecars(tmp, ["prefill"], "--log-level", "warning", token=TOKEN, env=env)
        manifest = plan_manifest(load_hf_config("llama-3.1-8b"),
                                 PlanOptions(num_blocks=8, engine_id="cpu-probe"))  # fmt: skip
        pool = RankPool(manifest)
        try:
            pid = s.child.pid
            with s.client() as c:
                c.register(manifest, pool.specs())
                time.sleep(1.0)  # registration settles
                out = {"idle": share(pid, args.window)}
                ticket = c.hold(HoldRequest(request_id="probe", block_ids=[[1, 2]],
                                            num_tokens=32, lease_s=600))  # fmt: skip
            claim = ClaimRequest(ticket=ticket, reader="nobody", reader_tp_size=1, claim_s=600)
            body = msgspec.json.encode(claim)
            resp = httpx.post(f"http://{s.peer}/v1/claims", content=body,
                              headers=peer_headers("POST", "/v1/claims", body, TOKEN),
                              timeout=10)  # fmt: skip
            if resp.status_code != 200:
                print(f"claim refused: {resp.status_code} {resp.text}", file=sys.stderr)
                return 1
            out["claimed_first_s"] = share(pid, 1.0)
            out["claimed_steady"] = share(pid, args.window)
        finally:
            s.stop()
            pool.close()
    print(json.dumps({k: round(v, 4) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
