"""The ceilings of ``vram_pull.py``'s large pull, measured in the same run: a torch
device-to-device copy of the same bytes, and a bare NIXL READ of one VRAM descriptor between
two agents in two processes (verified, with the UCX lanes it took, read from UCX's protocol
log by :func:`ucx_excerpt`)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

SEED_RAW = 12345
"""Seed of the bare READ's source bytes."""


def ucx_excerpt(path: str, keep: int = 120) -> list[str]:
    """A UCX protocol-info log's tables for connections to other agents (not ``self``), and
    its warnings and errors: which lanes READs of which memory took."""
    out, table_of_self = [], False
    try:
        with open(path, errors="replace") as fh:
            for line in fh:
                body = line.split("]", 2)[-1].rstrip()
                if "cfg#" in body:
                    table_of_self = " self cfg#" in body
                if ("WARN" in body or "ERROR" in body) or ("|" in body and not table_of_self):
                    out.append(body.strip())
    except OSError as exc:
        return [f"(no log: {exc})"]
    return out[:keep]


def d2d_ceiling(nbytes: int, reps: int = 5) -> dict[str, Any]:
    """torch device-to-device copy of ``nbytes`` on cuda:0 (bytes copied per second)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "best_s": min(times), "gbps": nbytes / min(times) / 1e9,
            "median_gbps": nbytes / statistics.median(times) / 1e9}  # fmt: skip


def _raw_bytes(nbytes: int, device: str) -> Any:
    """The raw READ's source bytes (the same on every call)."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(SEED_RAW)
    out = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def _raw_agent(name: str) -> Any:
    """A bare NIXL agent with the UCX backend at NIXL's defaults."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _raw_source(conn: Any, nbytes: int, device: str, log_path: str) -> None:
    """Child process of the raw READ: owns the source buffer and its agent until told."""
    os.environ.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=log_path)
    import numpy as np

    src = _raw_bytes(nbytes, device)
    mem = "VRAM" if src.is_cuda else "DRAM"
    agent = _raw_agent(f"vram-raw-src-{os.getpid()}")
    table = np.array([[src.data_ptr(), nbytes, 0]], dtype=np.uint64)
    reg = agent.register_memory(table, mem)
    conn.send((agent.get_agent_metadata(), src.data_ptr()))
    with contextlib.suppress(EOFError):  # the parent is done (or gone)
        conn.recv()
    agent.deregister_memory(reg)


def raw_nixl_read(nbytes: int, tmp: str, reps: int = 5, device: str = "cuda:0") -> dict[str, Any]:
    """One VRAM descriptor of ``nbytes`` READ by an agent here from an agent in a child
    process (UCX, NIXL's default agent settings); the first READ (wire-up) is not timed. ``device``
    ``cpu`` makes it DRAM (to check this code without a GPU)."""
    import numpy as np
    import torch

    from kvxferd.transport.fabric import ProtoLog

    log_path = os.path.join(tmp, "raw-dst-ucx.log")
    saved = {k: os.environ.get(k) for k in ("UCX_PROTO_INFO", "UCX_LOG_FILE")}
    os.environ.update(UCX_PROTO_INFO="y", UCX_LOG_FILE=log_path)  # read as UCX loads, below

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    args = (there, nbytes, device, log_path + ".src")
    child = ctx.Process(target=_raw_source, args=args, daemon=True)
    child.start()
    out: dict[str, Any] = {"bytes": nbytes}
    try:
        if not here.poll(120):
            raise RuntimeError("raw source process gave no metadata in 120 s")
        meta, addr = here.recv()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        mem = "VRAM" if dst.is_cuda else "DRAM"
        agent = _raw_agent(f"vram-raw-dst-{os.getpid()}")
        mine = np.array([[dst.data_ptr(), nbytes, 0]], dtype=np.uint64)
        reg = agent.register_memory(mine, mem)
        remote = agent.add_remote_agent(meta)
        theirs = np.array([[addr, nbytes, 0]], dtype=np.uint64)
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(mine, mem),
            agent.get_xfer_descs(theirs, mem),
            remote,
            b"",
        )
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                if time.perf_counter() - t0 > 60:
                    raise RuntimeError("raw READ not done after 60 s")
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw READ ended {state}")
            if i:
                times.append(time.perf_counter() - t0)
        out["verified"] = bool(torch.equal(dst, _raw_bytes(nbytes, device)))
        out.update(
            best_s=min(times),
            gbps=nbytes / min(times) / 1e9,
            median_gbps=nbytes / statistics.median(times) / 1e9,
        )
        agent.release_xfer_handle(handle)
        agent.remove_remote_agent(remote)
        agent.deregister_memory(reg)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for k, v in saved.items():  # sidecars started later keep their own protocol logs
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(OSError):
            here.send("done")
        child.join(30)
        if child.is_alive():
            child.kill()
    lanes = ProtoLog(log_path).scan()
    out["transports"] = {
        "reads": {k: sorted(v) for k, v in lanes.reads.items()},
        "messages": {k: sorted(v) for k, v in lanes.messages.items()},
    }
    out["ucx_proto_log"] = ucx_excerpt(log_path)
    out["ucx_proto_log_source"] = ucx_excerpt(log_path + ".src", keep=30)
    return out


def ceilings(result: dict[str, Any], nbytes: int, tmp: str, raw: bool) -> None:
    """The D2D copy and (``raw``) the raw NIXL READ of ``nbytes``, into ``result``."""
    result["d2d"] = d2d_ceiling(nbytes)
    print(f"ceiling: torch D2D copy of {nbytes / 1e6:.1f} MB: "
          f"{result['d2d']['gbps']:.1f} GB/s (one way)", flush=True)  # fmt: skip
    if raw:
        r = result["raw_nixl"] = raw_nixl_read(nbytes, tmp)
        lanes = r.get("transports", {}).get("reads")
        print(f"ceiling: raw NIXL READ, 1 VRAM descriptor, 2 processes: "
              f"{r.get('gbps', 0):.1f} GB/s, verified {r.get('verified')}, READ lanes {lanes}"
              + (f", error {r['error']}" if "error" in r else ""), flush=True)  # fmt: skip
