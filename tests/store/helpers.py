"""Shared pieces of the store tests: planned manifests, pattern-filled pools, block ids."""

from __future__ import annotations

import numpy as np

from kvxferd.layout import PlanOptions, plan_manifest, request_blocks
from kvxferd.layout.presets import load_hf_config
from kvxferd.pattern import write_pattern
from kvxferd.store import Store, chunk_keys
from kvxferd.wire import Manifest

DENSE, MAMBA2, GDN = "llama-3.1-8b", "granite-4.0-h-tiny", "qwen3-next-80b-a3b"
MiB = 1 << 20


def plan(preset: str, tp: int = 1, rank: int = 0, blocks: int = 8, **opts: object) -> Manifest:
    """The planner's manifest of one rank."""
    options = PlanOptions(tp_size=tp, tp_rank=rank, num_blocks=blocks, **opts)  # type: ignore[arg-type]
    return plan_manifest(load_hf_config(preset), options)


def pool(m: Manifest) -> list[np.ndarray]:
    """Zeroed regions of a manifest (plain numpy; the sidecar maps shared memory instead)."""
    return [np.zeros(r.size_bytes, dtype=np.uint8) for r in m.regions]


def block_ids(m: Manifest, tokens: int, descending: bool = False) -> list[list[int]]:
    """Distinct ids per group for a request of ``tokens`` (ascending from 1, or from the top)."""
    out, nxt = [], (m.num_blocks - 1 if descending else 1)
    for n in request_blocks(m, tokens):
        step = -1 if descending else 1
        out.append(list(range(nxt, nxt + step * n, step)))
        nxt += step * n
    return out


def filled(m: Manifest, tokens: int, seed: int, descending: bool = True):
    """(regions, block ids) of a request whose blocks hold the pattern of ``seed``."""
    regions, ids = pool(m), block_ids(m, tokens, descending)
    write_pattern(m, regions, ids, seed)
    return regions, ids


def keys(tokens: int, chunk: int, salt: bytes = b"") -> list[str]:
    """Chunk keys of a prompt of ``tokens`` ids 0..tokens-1."""
    return chunk_keys(list(range(tokens)), chunk, salt)


def store(root, chunk: int = 16, dram: int = 256 * MiB, files: int = 1 << 40) -> Store:  # noqa: ANN001
    """A store over ``root``."""
    return Store(str(root), chunk, dram, files)


def poisoned(m: Manifest, tokens: int, seed: int) -> tuple[list[np.ndarray], list[list[int]]]:
    """Blocks holding the pattern everywhere except what a load of ``tokens`` must write: those
    attention rows are 0xA5 and the Mamba states hold another seed's pattern. Verifying after a
    load then checks every loaded byte, and padding rows past ``tokens`` are never compared to
    something the load could not have written."""
    from kvxferd.store.canonical import fill_tokens

    regions, ids = filled(m, tokens, seed, descending=False)
    states = [g if m.groups[i].kind == "mamba" else [-1] * len(g) for i, g in enumerate(ids)]
    write_pattern(m, regions, states, seed + 1)
    for g, group in enumerate(m.groups):
        if group.kind != "mamba":
            fill_tokens(m, regions, g, np.asarray(ids[g]), 0, tokens, 0xA5)
    return regions, ids
