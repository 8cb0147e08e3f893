"""The sidecar-level target: a prefill and a decode ``kvxferd serve`` over pools this process
owns, so the campaign plays both engines and sees every byte.

Prefill side: each hold gets fresh scattered blocks written with its own pattern seed; when the
released feed reports a hold, its blocks are scribbled over at once (the engine reuses them), so
a READ that still lands after the release brings wrong bytes. Decode side: each pull gets fresh
scattered blocks filled with a sentinel.
"""

from __future__ import annotations

import json
import os
import random
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

from kvxferd import descriptors
from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.sim.kvpool import RankPool
from kvxferd.wire import HoldRequest, Manifest, Ticket

from .node import Node

TOY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 256, "num_hidden_layers": 24, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip
"""A model with many small pages: 24 layers of 1 KiB per block, so a pull of 1,500 scattered
blocks posts ~36k descriptors (long posts) while a pool of 2,048 blocks is only 48 MiB."""
NUM_BLOCKS = 2048
LEASE_S = 4.0
"""Default hold lease of the pair's prefill sidecar (leaked holds show up within seconds)."""
SENTINEL = 0xA5
SCRIBBLE = 0x5A
TOKENS_PER_BLOCK = 16
HOLD_GRACE_S = 3.0
"""Slack after a hold's lease (or its pull's claim) before a missing release is a leak."""


def write_toy_config(tmp: str) -> str:
    """The toy model's config.json under ``tmp``; its path."""
    path = os.path.join(tmp, "toy-config.json")
    with open(path, "w") as fh:
        json.dump(TOY_CONFIG, fh)
    return path


def block_rows(manifest: Manifest, ids: list[int]) -> list[tuple[int, np.ndarray]]:
    """Where the blocks ``ids`` live, per region: ``(unit, rows)`` such that the rows of
    ``region.reshape(-1, unit)`` are exactly their bytes (layouts put K, V and layers anywhere
    in a region, so block ``b`` is not row ``b``)."""
    arr = [np.asarray(ids, dtype=np.int64)]
    plan = descriptors.plan_read(manifest, manifest, arr, arr, coalesce=False)
    out = []
    for r, region in enumerate(manifest.regions):
        sel = plan.local_region == r
        off, length = plan.local_offset[sel], plan.length[sel]
        unit = int(np.gcd.reduce(np.concatenate([off, length, [region.size_bytes]])))
        counts = length // unit
        first = np.repeat(off // unit - (np.cumsum(counts) - counts), counts)
        out.append((unit, first + np.arange(int(counts.sum()))))
    return out


def _manifest(config: str, tag: str) -> Manifest:
    opts = PlanOptions(num_blocks=NUM_BLOCKS, engine_id=f"camp{tag}{uuid.uuid4().hex[:6]}")
    return plan_manifest(load_hf_config(config), opts)


@dataclass
class HoldRec:
    """A hold the campaign placed: its ticket, blocks, pattern seed and who answers for it."""

    ticket: Ticket
    blocks: list[int]
    seed: int
    kind: str
    generation: int
    due: float
    """Wall time by which it must be released (lease or the claim of a pull, plus slack)."""
    released: int = 0


@dataclass
class Blocks:
    """Free block ids of one pool (block 0 is the null block, never used)."""

    free: set[int] = field(default_factory=lambda: set(range(1, NUM_BLOCKS)))

    def take(self, rng: random.Random, n: int) -> list[int]:
        n = min(n, len(self.free))
        ids = rng.sample(sorted(self.free), n)
        self.free.difference_update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        self.free.update(ids)


class Pair:
    """Prefill node ``p`` and decode node ``d`` plus the campaign's view of their pools."""

    def __init__(self, tmp: str, config: str, env: dict[str, str], secret: str,
                 rng: random.Random) -> None:  # fmt: skip
        self.rng = rng
        self.secret = secret
        flags = ["--lease", str(LEASE_S), "--max-lease", "30", "--log-level", "warning"]
        self.p = Node("prefill", tmp, RankPool(_manifest(config, "p")), flags, env, secret)
        self.d = Node("decode", tmp, RankPool(_manifest(config, "d")), flags, env, secret)
        self.p_blocks = Blocks()
        self.d_blocks = Blocks()
        self.holds: dict[str, HoldRec] = {}
        self.released_ids: dict[str, str] = {}
        """Hold ids seen in the feed -> the kind that placed them ("" when not ours)."""
        self.duplicates: list[tuple[str, str]] = []
        """(kind, hold id) of every hold the feed reported a second time."""
        self._cursor = 0
        self._feed_generation = 0
        self._lock = threading.Lock()

    @property
    def pool_names(self) -> set[str]:
        return {r.name for n in (self.p, self.d) for r in n.pool.manifest.regions}

    def start(self) -> None:
        self.p.start()
        self.d.start()

    def close(self) -> None:
        for node in (self.d, self.p):
            node.stop()
        for node in (self.d, self.p):
            node.pool.close()

    # -------------------------------------------------------------- pool pages

    @staticmethod
    def pages(pool: RankPool, ids: list[int]) -> list[np.ndarray]:
        """Every byte of the blocks ``ids`` (all their layers' parts), per region (a copy)."""
        return [v.reshape(-1, unit)[rows] for v, (unit, rows) in
                zip(pool.views, block_rows(pool.manifest, ids), strict=True)]  # fmt: skip

    @staticmethod
    def fill(pool: RankPool, ids: list[int], value: int) -> None:
        """Set every byte of the blocks ``ids`` to ``value``."""
        for v, (unit, rows) in zip(pool.views, block_rows(pool.manifest, ids), strict=True):
            v.reshape(-1, unit)[rows] = value

    # -------------------------------------------------------------- prefill side

    def hold(self, kind: str, n: int, lease_s: float | None = None) -> HoldRec:
        """Place a hold on ``n`` fresh scattered blocks written with a new pattern."""
        from kvxferd.pattern import write_pattern

        if len(self.p_blocks.free) < n:
            self.poll_feed()  # blocks of holds released since the last look come back
        ids = self.p_blocks.take(self.rng, n)
        if not ids:
            raise RuntimeError("no free prefill blocks (holds not released)")
        seed = self.rng.getrandbits(48)
        pool = self.p.pool
        write_pattern(pool.manifest, pool.views, [ids], seed)
        req = HoldRequest(request_id=f"camp-{uuid.uuid4().hex[:12]}", block_ids=[ids],
                          num_tokens=n * TOKENS_PER_BLOCK, lease_s=lease_s)  # fmt: skip
        try:
            with self.p.client(30.0) as c:
                ticket = c.hold(req)
        except BaseException:
            self.p_blocks.give(ids)
            raise
        rec = HoldRec(ticket, ids, seed, kind, self.p.generation, ticket.expires_at + HOLD_GRACE_S)
        with self._lock:
            self.holds[ticket.hold_id] = rec
        return rec

    def extend_due(self, rec: HoldRec, until_wall: float) -> None:
        """A pull's claim may keep the hold until ``until_wall``."""
        rec.due = max(rec.due, until_wall + HOLD_GRACE_S)

    def poll_feed(self) -> int:
        """Read the prefill's released feed; scribble over and free released blocks at once.
        Returns the number of new releases (0 when the prefill does not answer)."""
        with self._lock:
            if self._feed_generation != self.p.generation:
                self._forget_generation()
            try:
                with self.p.client(5.0) as c:
                    feed = c.released(self._cursor)
            except Exception:  # noqa: BLE001 - a dead or stopped prefill: nothing to read now
                return 0
            self._cursor = feed.cursor
            for h in feed.holds:
                rec = self.holds.pop(h.hold_id, None)
                if h.hold_id in self.released_ids:
                    self.duplicates.append((self.released_ids[h.hold_id], h.hold_id))
                    continue
                self.released_ids[h.hold_id] = rec.kind if rec is not None else ""
                if rec is not None:
                    self.fill(self.p.pool, rec.blocks, SCRIBBLE)
                    self.p_blocks.give(rec.blocks)
            return len(feed.holds)

    def _forget_generation(self) -> None:
        """The prefill restarted: holds of its previous life died with it (blocks are ours)."""
        for hold_id, rec in list(self.holds.items()):
            if rec.generation != self.p.generation:
                del self.holds[hold_id]
                self.p_blocks.give(rec.blocks)
        self._cursor = 0
        self._feed_generation = self.p.generation

    def overdue(self, now_wall: float) -> list[HoldRec]:
        """Holds of the running prefill past their due time without a release (removed)."""
        with self._lock:
            late = [r for r in self.holds.values()
                    if r.generation == self.p.generation and now_wall > r.due]  # fmt: skip
            for r in late:
                del self.holds[r.ticket.hold_id]
            return late

    def take_duplicates(self) -> list[tuple[str, str]]:
        with self._lock:
            out, self.duplicates = self.duplicates, []
            return out

    def pending(self) -> list[HoldRec]:
        with self._lock:
            return [r for r in self.holds.values() if r.generation == self.p.generation]

    # -------------------------------------------------------------- decode side

    def dest(self, n: int) -> list[int]:
        """``n`` fresh scattered decode blocks filled with the sentinel (fewer when fewer are
        free: quarantined blocks of hung pulls stay out)."""
        ids = self.d_blocks.take(self.rng, n)
        self.fill(self.d.pool, ids, SENTINEL)
        return ids
