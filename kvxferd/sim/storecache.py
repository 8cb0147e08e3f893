"""The store as the simulated prefill's prefix-cache tier (``kvxferd sim --store DIR``).

Before "computing" a prompt, the prefill asks every rank's sidecar how much of it the store
holds. On a full hit it loads the bytes from the store instead of writing the pattern, then
verifies every byte; on a miss (or a failed or wrong load) it writes the pattern and saves it.

The sim's KV bytes are a function of the whole prompt (its seed), not of each prefix, so the
chunk-key chain is salted with the seed: only the same prompt matches, never a different prompt
that shares a prefix. Only full hits are used (a partial one is a miss here). Padding rows after
the prompt's last token, which a store never holds, are not verified (the token pattern covers
the prompt's tokens and the state blocks); the rows and states a load must supply are poisoned
first (attention 0xA5, Mamba states another seed's pattern), so verification fails unless the
load wrote every one of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from kvxferd.errors import KvxferdError
from kvxferd.pattern import verify_token_pattern, write_token_pattern
from kvxferd.store import chunk_keys
from kvxferd.store.canonical import fill_tokens
from kvxferd.wire import Manifest, StoreLoadRequest, StoreLookupRequest, StoreSaveRequest

if TYPE_CHECKING:
    from kvxferd.sim.engine import SimEngine

log = logging.getLogger(__name__)

POISON = 0xA5
_STATE_SALT = 0x5A5A5A5A


def prompt_keys(tokens: Sequence[int], seed: int, chunk_tokens: int) -> list[str]:
    """The store keys of a sim prompt (the chain salted with its seed)."""
    return chunk_keys(tokens, chunk_tokens, seed.to_bytes(8, "little"))


def poison(m: Manifest, views: list[np.ndarray], ids: list[list[int]], seed: int, n: int) -> None:
    """Poison every byte a load of ``n`` tokens must write: another seed's token pattern (the
    Mamba states), then 0xA5 over the attention rows."""
    write_token_pattern(m, views, ids, n, seed ^ _STATE_SALT)
    for g, group in enumerate(m.groups):
        if group.kind != "mamba":
            fill_tokens(m, views, g, np.asarray(ids[g], dtype=np.int64), 0, n, POISON)


async def fill(engine: SimEngine, tokens: list[int], ids: list[list[int]], seed: int) -> None:
    """Fill a prefill's blocks from the store when it holds the whole prompt, else compute
    (write the pattern) and save; every path ends with correct bytes in the blocks."""
    n, chunk = len(tokens), engine.settings.store_chunk_tokens
    keys = prompt_keys(tokens, seed, chunk)
    stats = engine.stats
    try:
        hits = await asyncio.gather(
            *(c.store_lookup(StoreLookupRequest(keys=keys, num_tokens=n)) for c in engine.clients)
        )
        stats.store_lookups += 1
        if n and all(h.matched == n for h in hits) and await _load(engine, keys, ids, seed, n):
            stats.store_hit_tokens += n
            return
    except (KvxferdError, httpx.HTTPError) as exc:
        log.warning("store lookup failed, computing instead: %s", exc)
    await _on_ranks(engine, write_token_pattern, ids, n, seed)
    save = StoreSaveRequest(request_id=f"sim-{seed:x}", block_ids=ids, keys=keys, num_tokens=n)
    results = await asyncio.gather(
        *(c.store_save(save) for c in engine.clients), return_exceptions=True
    )
    bad = [r for r in results if isinstance(r, BaseException)]
    if bad:
        stats.store_save_failed += 1
        log.warning("store save failed on %d rank(s): %s", len(bad), bad[0])
    else:
        stats.store_saves += 1


async def _on_ranks(
    engine: SimEngine, fn: Callable[..., Any], ids: list[list[int]], n: int, seed: int
) -> list[Any]:
    """``fn(manifest, views, ids, n, seed)`` on every rank's pool at once, in worker threads."""
    return await asyncio.gather(
        *(asyncio.to_thread(fn, p.manifest, p.views, ids, n, seed) for p in engine.pools)
    )


async def _load(
    engine: SimEngine, keys: list[str], ids: list[list[int]], seed: int, n: int
) -> bool:
    """Poison, load on every rank, verify every byte; False (counted) when anything failed."""
    stats = engine.stats
    await asyncio.gather(
        *(asyncio.to_thread(poison, p.manifest, p.views, ids, seed, n) for p in engine.pools)
    )
    req = StoreLoadRequest(keys=keys, block_ids=ids, num_tokens=n)
    done = await asyncio.gather(*(c.store_load(req) for c in engine.clients))
    failed = [s for s in done if s.state != "done"]
    if failed:
        stats.store_loads_failed += 1
        log.warning("store load failed (%s: %s); computing instead", failed[0].reason,
                    failed[0].detail)  # fmt: skip
        return False
    stats.store_kv_bytes += sum(s.kv_bytes for s in done)
    stats.store_state_bytes += sum(s.state_bytes for s in done)
    found = await _on_ranks(engine, verify_token_pattern, ids, n, seed)
    wrong = [m for m in found if m is not None]
    if wrong:
        stats.store_verified_failed += 1
        log.error("bytes loaded from the store differ: %s", wrong[0])
        return False
    stats.store_verified_ok += 1
    return True
