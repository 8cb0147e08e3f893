"""Engine ranks for the pull benchmark: a small Mamba2 hybrid, slots of 16 blocks, verified pulls.

A ``Rank`` is one engine rank: its ``kvxferd serve`` child (a pod's ranks share one), planned
manifest and shm pool. The
decode rank (TP 1) and the prefill ranks (TP 1..8) share block ids: slot ``s`` owns the same
16 blocks on every side, so concurrent pulls never write the same decode block. Every prefill
rank's slot holds ``kvxferd.pattern`` bytes (seed per slot); a verified pull scrubs its decode
slot to SENTINEL first and checks every byte of every layer of every block afterwards.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxferd import descriptors
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.pattern import verify_pattern, write_pattern
from kvxferd.wire import HoldRequest, Manifest, PullRequest, PullStatus, Ticket

from .procs import SENTINEL, Pool, SidecarProcess

HYBRID = {
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 16,
    "layer_types": ["mamba"] * 3 + ["attention"] + ["mamba"] * 3 + ["attention"],
    "mamba_n_heads": 16,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
}
"""granite-4.0-h-tiny cut down: 6 Mamba2 layers (one group: B/C replicated under TP) and 2
attention layers with 8 KV heads, so TP 1, 2, 4 and 8 all shard it. 32-token blocks, 16 KiB
pages in 2 regions; a 16-block pull moves ~0.5 MB."""
BLOCKS_PER_PULL = 16
"""Blocks of one pull: one running state per Mamba group, the rest attention."""
SEED0 = 1000
LEASE_S = 300.0
"""Holds are placed before a round starts; they must outlive it on a loaded machine."""
PULL_DEADLINE_S = 60.0


class BenchError(RuntimeError):
    """The benchmark cannot report a number (a pull failed, moved wrong bytes, or a hold was
    not released by its reader's notification)."""


def hybrid_config(scale: int = 1) -> dict:
    """The bench model; ``scale`` multiplies its head sizes (attention and Mamba), so each
    block's rows (and a pull's bytes) grow ``scale`` times."""
    heads = {k: HYBRID[k] * scale for k in ("head_dim", "mamba_d_head", "hidden_size")}
    return {**load_hf_config("granite-4.0-h-tiny"), **HYBRID, **heads}


def plan(tp_size: int, tp_rank: int, num_blocks: int, scale: int = 1) -> Manifest:
    """A manifest of the bench model (``hybrid_config(scale)``) with region (shm) names unique
    to this run."""
    opts = PlanOptions(tp_size=tp_size, tp_rank=tp_rank, num_blocks=num_blocks,
                       engine_id=f"b{uuid.uuid4().hex[:8]}")  # fmt: skip
    return plan_manifest(hybrid_config(scale), opts)


def slot_ids(m: Manifest, slots: int) -> tuple[list[list[list[int]]], int, int]:
    """Per slot, block ids per group; the pool size they need; the request's tokens."""
    mamba = sum(1 for g in m.groups if g.kind == "mamba")
    attn = len(m.groups) - mamba
    per_attn = (BLOCKS_PER_PULL - mamba) // max(1, attn)
    counts = [1 if g.kind == "mamba" else per_attn for g in m.groups]
    tokens = per_attn * min(g.block_size for g in m.groups if g.kind != "mamba")
    per_slot = sum(counts)
    out = []
    for s in range(slots):
        start, ids = 1 + s * per_slot, []  # block 0 stays unused (vLLM's null block)
        for c in counts:
            ids.append(list(range(start, start + c)))
            start += c
        out.append(ids)
    return out, 1 + slots * per_slot, tokens


@dataclass
class Rank:
    """One engine rank: its sidecar, manifest and pool."""

    sidecar: SidecarProcess
    manifest: Manifest
    pool: Pool

    def register(self) -> None:
        with self.sidecar.client() as c:
            c.register(self.manifest, self.pool.specs())

    def close(self) -> None:
        self.sidecar.stop()
        self.pool.close()


class Rig:
    """A decode rank and the current prefill engine's ranks, with ``slots`` slots of blocks."""

    def __init__(self, decode: Rank, slots: int) -> None:
        self.decode = decode
        self.slots = slots
        self.ids, self.num_blocks, self.tokens = slot_ids(decode.manifest, slots)
        self.prefills: list[Rank] = []
        self._scrub = []
        for ids in self.ids:
            own = [np.asarray(g, dtype=np.int64) for g in ids]
            p = descriptors.plan_read(decode.manifest, decode.manifest, own, own, coalesce=False)
            self._scrub.append(list(zip(p.local_region.tolist(), p.local_offset.tolist(),
                                        p.length.tolist(), strict=True)))  # fmt: skip
        self.expected_bytes = 0
        self.pod = False  # the prefill ranks share one pod sidecar
        self._cursors: list[int] = []

    def attach(self, prefills: list[Rank]) -> None:
        """Use these prefill ranks (registered): write every slot's pattern on each."""
        self.prefills = prefills
        self.pod = len(prefills) > 1 and prefills[0].sidecar is prefills[1].sidecar
        self._cursors = [0] * len(prefills)
        for r in prefills:
            for s, ids in enumerate(self.ids):
                write_pattern(r.manifest, r.pool.views, ids, seed=SEED0 + s)
        own = [np.asarray(g, dtype=np.int64) for g in self.ids[0]]
        tp = prefills[0].manifest.tp_size
        self.expected_bytes = sum(
            descriptors.plan_read(self.decode.manifest, prefills[r].manifest, own, own).total_bytes
            for r in descriptors.source_ranks(self.decode.manifest, tp)
        )

    async def place_holds(self, clients: list, pulls: int, slots: int, width: int = 64
                          ) -> list[list[Ticket]]:  # fmt: skip
        """``pulls`` ticket lists (one ticket per prefill rank, rank order; a pod's one ticket,
        every rank having placed the hold); pull ``i`` reads slot ``i % slots``."""
        gate = asyncio.Semaphore(width)

        async def one(i: int) -> list[Ticket]:
            ids, rid = self.ids[i % slots], f"pb-{uuid.uuid4().hex[:12]}"
            req = HoldRequest(request_id=rid, block_ids=ids, num_tokens=self.tokens,
                              lease_s=LEASE_S)  # fmt: skip
            reqs = [req] * len(clients)
            if self.pod:  # every rank places the hold under one id (the scheduler's)
                reqs = [msgspec.structs.replace(req, hold_id=rid, tp_rank=r)
                        for r in range(len(clients))]  # fmt: skip
            async with gate:
                got = await asyncio.gather(*(c.hold(q) for c, q in zip(clients, reqs, strict=True)))
            return list(got[:1] if self.pod else got)

        return list(await asyncio.gather(*(one(i) for i in range(pulls))))

    def scrub(self, slot: int) -> None:
        views = self.decode.pool.views
        for r, off, n in self._scrub[slot]:
            views[r][off : off + n] = SENTINEL

    def verify(self, slot: int) -> None:
        bad = verify_pattern(self.decode.manifest, self.decode.pool.views, self.ids[slot],
                             seed=SEED0 + slot)  # fmt: skip
        if bad is not None:
            raise BenchError(f"slot {slot}: pull reported done but moved wrong bytes: {bad}")

    def request(self, slot: int, tickets: list[Ticket]) -> PullRequest:
        return PullRequest(tickets=tickets, block_ids=self.ids[slot], deadline_s=PULL_DEADLINE_S)

    def check(self, status: PullStatus) -> None:
        if status.state != "done":
            raise BenchError(f"pull ended {status.state}: {status.reason} {status.detail}")
        moved = status.kv_bytes + status.state_bytes
        if moved != self.expected_bytes:
            raise BenchError(f"pull moved {moved} B, expected {self.expected_bytes}")

    async def wait_released(self, clients: list, tickets: list[list[Ticket]],
                            timeout_s: float = 60.0) -> None:  # fmt: skip
        """Bounded: every hold of ``tickets`` released on its rank, each as ``notified`` (a
        pod's: on its one feed)."""
        for r, c in enumerate(clients[: len(tickets[0])]):
            want = {t[r].hold_id for t in tickets}
            deadline = time.monotonic() + timeout_s
            while want:
                feed = await c.released(self._cursors[r])
                self._cursors[r] = feed.cursor
                for h in feed.holds:
                    if h.hold_id in want:
                        if h.reason != "notified":
                            raise BenchError(f"hold {h.hold_id} released {h.reason}")
                        want.discard(h.hold_id)
                if want and time.monotonic() > deadline:
                    raise BenchError(f"rank {r}: {len(want)} holds not released in {timeout_s} s")
                if want and not feed.holds:
                    await asyncio.sleep(0.01)


def pct(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]
