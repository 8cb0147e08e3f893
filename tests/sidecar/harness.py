"""Test harness: real ``kvxferd serve`` processes and engine-side KV pools in shared memory.

A ``Sidecar`` is a child process started exactly as an operator would (``python -m kvxferd
serve``) by the package's own launcher (kvxferd.sim.sidecars); readiness is its stdout line,
waited for with a deadline. An ``EnginePool`` is what an engine rank owns: one shared-memory
segment per manifest region, registered through the client.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
import numpy as np

from kvxferd.layout import PlanOptions, load_hf_config, plan_manifest
from kvxferd.sidecar.signing import PeerKeys, not_before, sign_request
from kvxferd.sim import sidecars as launcher
from kvxferd.sim.kvpool import RankPool
from kvxferd.sim.sidecars import SidecarProcess
from kvxferd.wire import Manifest

TOKEN = "test-peer-secret"
SENTINEL = 0xA5


Sidecar = SidecarProcess
"""A running ``kvxferd serve`` child (the package's launcher type: socket, peer, engine_id,
epoch, child; client(), stop(), kill())."""


def _child_env(env: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """The children's environment (ours, loopback UCX, ``env`` on top) and their peer token."""
    extra = env or {}
    return {**os.environ, "UCX_NET_DEVICES": "lo", **extra}, extra.get("KVXFERD_PEER_TOKEN", TOKEN)


def start_sidecars(
    tmp_dir: str, names: list[str], *extra: str, port: int = 0, env: dict[str, str] | None = None
) -> list[Sidecar]:
    """Start one sidecar per name at once (socket ``tmp_dir/NAME.sock``, flags ``extra``) and
    wait (bounded) for every ready line; all or none. ``env`` adds to (or overrides) the
    children's environment, e.g. another KVXFERD_PEER_TOKEN."""
    child_env, token = _child_env(env)
    return launcher.start_sidecars(tmp_dir, names, "--log-level", "warning", *extra, token=token,
                                   port=port, env=child_env, merge_stderr=True)  # fmt: skip


def start_sidecar(
    tmp_dir: str, name: str, *extra: str, port: int = 0, env: dict[str, str] | None = None
) -> Sidecar:
    """Start one ``kvxferd serve`` (peer port ``port``, 0 = any) and wait for its ready line."""
    return start_sidecars(tmp_dir, [name], *extra, port=port, env=env)[0]


SMALL_HYBRID = {
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
"""granite-4.0-h-tiny cut down (on top of its config): 6 Mamba2 layers and 2 attention layers of
8 KV heads, so TP 1-8 all shard it (scripts/bench_pulls.py's model, kept there for the bench)."""

ONE_KV_HEAD = "llama-1kv"
"""A config name :func:`plan` knows beside the HF ones: llama-3.1-8b cut to 4 layers with a single
KV head, which every rank of a TP 2 engine holds (replicated: decode TP 1 reads it from rank 0
alone, and rank 1 is read by nobody)."""


def plan(config: str, *, tp_size: int = 1, tp_rank: int = 0, num_blocks: int = 16,
         **options: object) -> Manifest:  # fmt: skip
    """A planned manifest with region names unique to this test run."""
    engine = f"t{uuid.uuid4().hex[:8]}"
    opts = PlanOptions(tp_size=tp_size, tp_rank=tp_rank, num_blocks=num_blocks,
                       engine_id=engine, **options)  # type: ignore[arg-type]  # fmt: skip
    if config == ONE_KV_HEAD:
        hf = dict(load_hf_config("llama-3.1-8b"), num_key_value_heads=1, num_hidden_layers=4)
        return plan_manifest(hf, opts)
    return plan_manifest(load_hf_config(config), opts)


@dataclass
class EngineRank:
    """One engine rank: its sidecar (a pod's ranks share one), manifest and pool."""

    sidecar: Sidecar
    manifest: Manifest
    pool: EnginePool


class EnginePool(RankPool):
    """The sim's per-rank shm pool, filled with SENTINEL so untouched bytes can be checked."""

    def __init__(self, manifest: Manifest) -> None:
        super().__init__(manifest)
        for v in self.views:
            v[:] = SENTINEL

    def snapshot(self) -> list[np.ndarray]:
        return [v.copy() for v in self.views]


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):  # noqa: ANN001
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def encode(value: object) -> bytes:
    return msgspec.json.encode(value)


# ------------------------------------------------------------------------------------------------
# Several sidecars, scrapes of /metrics, the released feed (used by the hetero-TP, failure and
# metrics tests)
# ------------------------------------------------------------------------------------------------

QUIET = {"KVXFERD_PROGRESS_THREAD": "false"}
"""Env for sidecars without NIXL's UCX progress thread, which spins a full core per process
even when idle; the sidecar's notification poller progresses the worker instead (every 1 ms
while a hold is claimed). Used where a test runs three or more sidecars on CI's 2 cores."""


def peer_signature(sidecar: Sidecar, method: str, target: str, body: bytes,
                   keys: PeerKeys | None = None, skew_s: float = 30.0) -> str:  # fmt: skip
    """A KVX1 Authorization value for a call to ``sidecar``'s peer API, signed as a peer sidecar
    signs it: at its ``not_before`` while that is later than now (it started lately)."""
    floor = not_before(sidecar.epoch / 1e9, skew_s)
    return sign_request(keys or PeerKeys.of(TOKEN), method, target, body,
                        now=max(time.time(), floor))  # fmt: skip


def scrape(peer: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The peer port's /metrics as {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{peer}/metrics", timeout=10.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(peer: str, name: str, **labels: str) -> float:
    """One sample of the peer's /metrics (0 when absent: a labelled counter not yet touched)."""
    return scrape(peer).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_no_handles(*sidecars: Sidecar, timeout_s: float = 30.0) -> None:
    """Bounded wait until every sidecar reports 0 live NIXL transfer handles."""
    for s in sidecars:
        wait_until(
            lambda s=s: metric(s.peer, "kvxferd_nixl_handles") == 0,
            timeout_s,
            f"{s.peer}: kvxferd_nixl_handles back to 0",
        )


class ReleasedFeed:
    """Follows one sidecar's released-holds feed; ``wait_for`` blocks (bounded) for hold ids."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.cursor = 0
        self.seen: list[tuple[str, str]] = []  # (hold_id, reason), in feed order

    def poll(self) -> list[tuple[str, str]]:
        """Read new entries."""
        with self.sidecar.client() as c:
            feed = c.released(self.cursor)
        self.cursor = feed.cursor
        new = [(h.hold_id, h.reason) for h in feed.holds]
        self.seen.extend(new)
        return new

    def wait_for(self, *hold_ids: str, timeout_s: float = 30.0) -> dict[str, str]:
        """Reasons of ``hold_ids`` once all appeared in the feed."""

        def all_in() -> bool:
            self.poll()
            return set(hold_ids) <= {h for h, _ in self.seen}

        wait_until(all_in, timeout_s, f"release of {hold_ids}")
        return {h: r for h, r in self.seen if h in hold_ids}

    def count(self, hold_id: str) -> int:
        """How many times ``hold_id`` appeared (1 once released, never more)."""
        self.poll()
        return sum(1 for h, _ in self.seen if h == hold_id)


def changed_outside(before, after, manifest: Manifest, block_ids) -> int:  # noqa: ANN001
    """Bytes that changed outside the given blocks' parts of this rank (must be 0)."""
    from kvxferd import descriptors

    touched = [np.zeros(len(v), dtype=bool) for v in after]
    ids = [np.asarray(g, dtype=np.int64) for g in block_ids]
    own = descriptors.plan_read(manifest, manifest, ids, ids, coalesce=False)
    for r, off, n in zip(own.local_region, own.local_offset, own.length, strict=True):
        touched[r][off : off + n] = True
    return sum(int(((b != a) & ~t).sum()) for b, a, t in zip(before, after, touched, strict=True))


def split_ids(ids: np.ndarray, counts: list[int]) -> list[list[int]]:
    """Consecutive slices of ``ids`` of the given sizes, as plain int lists (one per group)."""
    out, start = [], 0
    for n in counts:
        out.append([int(b) for b in ids[start : start + n]])
        start += n
    return out


def held_on_first_call(module, name: str, monkeypatch, bound_s: float = 30.0  # noqa: ANN001
                       ) -> tuple[threading.Event, threading.Event]:  # fmt: skip
    """Make ``module.name``'s first call wait (at most ``bound_s``) for ``go_on``, with
    ``inside`` set meanwhile: a store copy stopped in the middle of one entry."""
    inside, go_on = threading.Event(), threading.Event()
    real = getattr(module, name)

    def held(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        if not inside.is_set():
            inside.set()
            assert go_on.wait(bound_s)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, held)
    return inside, go_on
