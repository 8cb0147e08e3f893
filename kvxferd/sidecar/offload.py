"""The sidecar's store calls (issue 12): save, lookup and load over the engine's own regions.

A thin layer over :class:`kvxferd.store.Store`: the store work runs in a worker thread (numpy
and file I/O release the GIL), the outcome becomes a wire answer, and metrics follow every
call. A load never raises for a missing or corrupt entry: it answers ``failed`` with the reason
(like a pull), and the engine recomputes. Bad input (block ids, keys) is a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvxferd.config import Config
from kvxferd.errors import (
    BlockIdError,
    ConfigError,
    PullError,
    SegmentTooSmallError,
    StoreError,
)
from kvxferd.metrics import STORE_TIERS, Metrics
from kvxferd.sidecar.clocks import act_by
from kvxferd.sidecar.hold_request import check_num_tokens, check_store_ids
from kvxferd.store import Store
from kvxferd.store.tiers import TierStats
from kvxferd.wire import (
    Manifest,
    StoreLoadRequest,
    StoreLoadStatus,
    StoreLookup,
    StoreLookupRequest,
    StoreSaved,
    StoreSaveRequest,
)
from kvxferd.wire.store import STORE_SAVE_DEADLINE_S

log = logging.getLogger(__name__)

MAX_STORE_DEADLINE_S = 600.0
"""Longest ``StoreLoadRequest.deadline_s`` accepted."""
STOP_S = 5.0
"""Seconds :meth:`Offload.stop` waits for the loads and saves on the engine's memory to end, and
:meth:`Offload.shutdown` for everything of the store, all steps together."""
CLOSE_MIN_S = 1.0
"""Seconds :meth:`Offload.shutdown` gives the store's own close even once its time is up: with
nothing blocked it takes milliseconds, so only a hung disk runs past it (exit status 3)."""
EXIT_STORE_STUCK = 3
"""``kvxferd serve``'s exit status when shutdown left store I/O blocked (a hung disk): see
:meth:`Offload.exit_if_stuck`."""
T = TypeVar("T")
V = TypeVar("V")

Target = Callable[[int | None, int], tuple[Manifest, list[np.ndarray]]]
"""Given a call's registration generation and ``tp_rank``: the manifest of that rank's memory
and a host view of each of its regions (a pod sidecar's: the named rank's; raises if none is
registered, if the generation, when given, is not the registered one, or if a pod's call names
no rank of it)."""
HoldBlocks = Callable[[str, int], tuple[list[list[int]], int, Callable[[], None]]]
"""Given a hold id and the saving ``tp_rank``: the live hold's (block ids per group, tokens, a
check that raises HoldExpiredError once the hold no longer pins them); raises UnknownHoldError/
HoldExpiredError, or StoreError naming ``hold_id`` when that pod rank has not placed it."""
Guard = Callable[[], None]
"""Raises SegmentTooSmallError once a region's segment no longer backs it (run before each
entry's copy: touching the truncated pages would kill the sidecar with SIGBUS)."""


def _no_holds(hold_id: str, tp_rank: int) -> tuple[list[list[int]], int, Callable[[], None]]:
    raise StoreError("hold_id", "this sidecar cannot look holds up")


def _intact() -> None:
    """The guard of regions that cannot shrink."""


def _rank_target(target: Target, generation: int | None, tp_rank: int) -> tuple[Manifest, Any]:
    """``target``'s memory for ``tp_rank``, checked to be that rank's (StoreError naming
    ``tp_rank`` when the sidecar's memory is another rank's: its entries would be that rank's)."""
    manifest, regions = target(generation, tp_rank)
    if tp_rank not in (-1, manifest.tp_rank):
        raise StoreError("tp_rank", f"{tp_rank}, but this sidecar's engine is rank "
                         f"{manifest.tp_rank} (-1 or its own rank)")  # fmt: skip
    return manifest, regions


def _check_ids(manifest: Manifest, block_ids: list[list[int]], num_tokens: int) -> None:
    """A save's or load's bounds: ``num_tokens`` 0..MAX_TOKENS (StoreError), then a hold's rule
    for the lists (one per group, each at most the blocks the tokens span plus HOLD_SPARE_BLOCKS)
    before any id is looked at, then ids in range and not repeated, then a full-attention list
    at least as long as the blocks the tokens span (BlockIdError). A shorter list is a sliding
    window's last blocks; read so, a full-attention one would save nothing and say nothing."""
    check_num_tokens(num_tokens, StoreError)
    sizes = tuple(g.block_size for g in manifest.groups)
    check_store_ids(manifest.num_blocks, sizes, num_tokens, block_ids)
    for g, (group, ids) in enumerate(zip(manifest.groups, block_ids, strict=True)):
        span = -(-num_tokens // group.block_size)
        if group.kind == "full_attention" and len(ids) < span:
            raise BlockIdError(f"block_ids[{g}]", f"{len(ids)} ids; {num_tokens} tokens in blocks "
                               f"of {group.block_size} span {span} (a full-attention group lists "
                               "each, -1 for one not to save)")  # fmt: skip


def _prefix_ids(
    manifest: Manifest, block_ids: list[list[int]], held: int, num_tokens: int
) -> list[list[int]]:
    """A hold's id lists as the lists of its first ``num_tokens`` tokens. A short list (a
    sliding window's) ends at the block of the hold's last token, not the prefix's: read as the
    prefix's, its blocks would be saved under other tokens' keys. Mamba lists stay as they are
    (a hybrid hold is saved whole)."""
    if num_tokens == held or len(block_ids) != len(manifest.groups):
        return block_ids  # (a list per group or not: the store refuses the latter)
    out = []
    for group, ids in zip(manifest.groups, block_ids, strict=True):
        if group.kind == "mamba":
            out.append(ids)
            continue
        first = max(0, -(-held // group.block_size) - len(ids))  # request block of ids[0]
        out.append(([-1] * first + list(ids))[: -(-num_tokens // group.block_size)])
    return out


@dataclass
class _Reported:
    """Tier counters already added to the metrics (they are monotonic in the tiers)."""

    evictions: int = 0
    corrupt: int = 0


class Offload:
    """Store calls of one sidecar; without ``config.store_dir`` every call is a StoreError."""

    def __init__(
        self, config: Config, metrics: Metrics, target: Target, holds: HoldBlocks = _no_holds,
        guard: Guard = _intact,
    ) -> None:  # fmt: skip
        self.metrics = metrics
        self._target = target
        self._holds = holds
        self._guard = guard
        self.store: Store | None = None
        if config.store_dir:
            try:
                self.store = Store(
                    config.store_dir,
                    config.store_chunk_tokens,
                    config.store_dram_bytes,
                    config.store_file_bytes,
                    file_entries=config.store_file_entries,
                )
            except OSError as exc:
                raise ConfigError(f"store_dir: {config.store_dir}: {exc.strerror}") from exc
        self._reported = {tier: _Reported() for tier in STORE_TIERS}
        self._running: dict[asyncio.Future[Any], threading.Event] = {}  # work on engine memory
        self._lookups: dict[asyncio.Future[Any], None] = {}  # lookups (no engine memory)
        self.stuck = ""
        """What of the store :meth:`shutdown` left blocked in I/O ("" when nothing)."""
        self._shutdown_by = math.inf  # monotonic; set by begin_shutdown (SIGINT/SIGTERM)
        self._shutdown_from = math.inf  # when begin_shutdown was called

    async def save(self, req: StoreSaveRequest) -> StoreSaved:
        """Copy a request's blocks (or a live hold's) into the store; entries already there are
        skipped. Nothing is copied past STORE_SAVE_DEADLINE_S from now: the engine frees the
        blocks once its client gives up, a margin later; nor is an entry whose copy ended past
        the call's ``not_after_ns`` kept."""
        stop_at = time.monotonic() + STORE_SAVE_DEADLINE_S
        store = self._require()
        manifest, regions = _rank_target(self._target, req.generation, req.tp_rank)
        block_ids, num_tokens, pinned = req.block_ids, req.num_tokens, None
        if req.hold_id:
            if block_ids:
                raise StoreError("block_ids", "give block_ids or hold_id, not both")
            block_ids, held_tokens, pinned = self._holds(req.hold_id, req.tp_rank)
            num_tokens = held_tokens if num_tokens < 0 else num_tokens
            if not 0 <= num_tokens <= held_tokens:
                raise StoreError("num_tokens", f"{num_tokens} outside the hold's {held_tokens}")
            if num_tokens != held_tokens and any(g.kind == "mamba" for g in manifest.groups):
                # A Mamba state block holds the state after the hold's last token, never after
                # an earlier one: saved under a shorter prefix's key it would load wrong state.
                raise StoreError("num_tokens", f"{num_tokens}: a hybrid hold saves all its "
                                 f"{held_tokens} tokens")  # fmt: skip
            block_ids = _prefix_ids(manifest, block_ids, held_tokens, num_tokens)
        else:  # (a hold's ids passed the same checks when it was placed)
            _check_ids(manifest, block_ids, num_tokens)
        by = act_by(req.not_after_ns, self.metrics.calls_expired.labels("store_save").inc)
        stop_at = min(stop_at, by)
        stop = self._stop_event()  # set by stop(): the engine's memory is being let go
        out = await asyncio.shield(self._track(
            self._running, stop, store.save, manifest, regions, block_ids, req.keys, num_tokens,
            self._guard, pinned,  # a hold let go during a copy: that entry is not kept
            stop_at, stop,
        ))  # fmt: skip
        if out.cut:
            log.warning("store save %s stopped (%s) after %d entries", req.request_id, out.cut,
                        out.chunks_saved)  # fmt: skip
        self.metrics.store_bytes.labels("dram", "save").inc(out.dram_bytes)
        self.metrics.store_bytes.labels("file", "save").inc(out.file_bytes)
        self._sync_tiers()
        return StoreSaved(
            chunks_saved=out.chunks_saved, chunks_present=out.chunks_present,
            chunks_skipped=out.chunks_skipped,
            kv_bytes=out.kv_bytes, state_bytes=out.state_bytes, dram_bytes=out.dram_bytes,
            file_bytes=out.file_bytes, duration_s=out.duration_s,
        )  # fmt: skip

    async def lookup(self, req: StoreLookupRequest) -> StoreLookup:
        """Tokens each group can serve and the prefix all can (the minimum rule)."""
        store = self._require()
        manifest, _regions = _rank_target(self._target, None, req.tp_rank)
        check_num_tokens(req.num_tokens, StoreError)
        # known to shutdown until its thread ends (on a hung disk: never)
        out = await asyncio.shield(
            self._track(self._lookups, None, store.lookup, manifest, req.keys, req.num_tokens)
        )
        self.metrics.store_lookup_tokens.labels("hit").inc(out.matched)
        self.metrics.store_lookup_tokens.labels("miss").inc(req.num_tokens - out.matched)
        if out.disagree:
            self.metrics.store_disagreements.inc()
        return StoreLookup(matched_tokens=out.per_group, matched=out.matched, disagree=out.disagree)

    async def load(self, req: StoreLoadRequest) -> StoreLoadStatus:
        """Write the first ``num_tokens`` tokens into local blocks; failed (with a reason) when an
        entry is missing or corrupt."""
        if not (math.isfinite(req.deadline_s) and 0 < req.deadline_s <= MAX_STORE_DEADLINE_S):
            raise StoreError("deadline_s", f"must be in (0, {MAX_STORE_DEADLINE_S:g}]")
        store = self._require()
        manifest, regions = _rank_target(self._target, req.generation, req.tp_rank)
        _check_ids(manifest, req.block_ids, req.num_tokens)
        by = act_by(req.not_after_ns, self.metrics.calls_expired.labels("store_load").inc)
        stop_at, stop = min(time.monotonic() + req.deadline_s, by), self._stop_event()
        try:
            # Awaited to its end even if our caller gives up: the answer says nothing is written
            # any more (the thread checks ``stop_at`` and ``stop`` between entries).
            out = await asyncio.shield(self._track(
                self._running, stop, store.load, manifest, regions, req.block_ids, req.keys,
                req.num_tokens, stop_at, stop, self._guard,
            ))  # fmt: skip
        except (PullError, SegmentTooSmallError) as exc:
            log.warning("store load %s failed: %s", req.request_id or "-", exc)
            self.metrics.store_loads.labels("failed").inc()
            self._sync_tiers()
            if isinstance(exc, SegmentTooSmallError):
                return StoreLoadStatus(state="failed", reason=exc.code, detail=str(exc))
            return StoreLoadStatus(state="failed", reason=exc.reason, detail=exc.detail)
        self.metrics.store_loads.labels("done").inc()
        self.metrics.store_bytes.labels("dram", "load").inc(out.dram_bytes)
        self.metrics.store_bytes.labels("file", "load").inc(out.file_bytes)
        self._sync_tiers()
        served = out.dram_bytes + out.file_bytes
        return StoreLoadStatus(
            state="done", tokens=out.tokens, kv_bytes=out.kv_bytes, state_bytes=out.state_bytes,
            dram_bytes=out.dram_bytes, file_bytes=out.file_bytes,
            dram_hit_rate=out.dram_bytes / served if served else 0.0, duration_s=out.duration_s,
        )  # fmt: skip

    async def stop(self, timeout_s: float = STOP_S) -> int:
        """Stop the loads and saves in progress from copying further entries (one being copied
        finishes; a save answers what it stored) and wait up to ``timeout_s`` for them to end:
        how many still run."""
        running = list(self._running)
        for stop in self._running.values():
            stop.set()
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        return sum(not work.done() for work in running)

    def begin_shutdown(self, deadline: float) -> None:
        """SIGINT/SIGTERM: the loads and saves running stop before their next entry now (one
        started later at once), and :meth:`shutdown` waits for nothing past ``deadline``
        (monotonic) but the store's close (``CLOSE_MIN_S``)."""
        self._shutdown_by, self._shutdown_from = deadline, time.monotonic()
        for stop in self._running.values():
            stop.set()

    async def shutdown(self, timeout_s: float = STOP_S) -> int:
        """:meth:`stop`, then, once no load or save runs, the lookups waited for and
        :meth:`close` waited for, within ``timeout_s`` (and the :meth:`begin_shutdown`
        deadline) all together: how many loads and saves still copy the engine's memory. While
        any does, the store stays open (the copy's entry goes on to the store) and the caller
        must not unmap the memory. Whatever still blocks a thread (a hung disk) is named in
        ``stuck``: the process must not wait for it at exit (:meth:`exit_if_stuck`)."""
        now = time.monotonic()
        by, start = min(now + timeout_s, self._shutdown_by), min(now, self._shutdown_from)

        def left() -> float:
            return max(0.0, by - time.monotonic())

        def waited() -> str:
            return f"{time.monotonic() - start:.1f}"

        copying = await self.stop(left())
        if copying:
            log.warning("shutdown: %d store loads or saves still copy the engine's memory after "
                        "%s s: it stays mapped and the store open until they end", copying,
                        waited())  # fmt: skip
            self.stuck = f"{copying} store loads or saves"
            return copying
        lookups = list(self._lookups)
        if lookups:
            await asyncio.wait(lookups, timeout=left())
        looking = sum(not work.done() for work in lookups)
        if looking:
            log.warning("shutdown: %d store lookups did not end in %s s (a hung disk?)", looking,
                        waited())  # fmt: skip
            self.stuck = f"{looking} store lookups"
        try:
            await asyncio.wait_for(asyncio.to_thread(self.close), max(left(), CLOSE_MIN_S))
        except TimeoutError:
            log.warning("shutdown: the store's I/O threads did not end in %s s (a hung disk?)",
                        waited())  # fmt: skip
            self.stuck = self.stuck or "the store's I/O threads"
        return 0

    def exit_if_stuck(self) -> None:
        """End the process at once, with EXIT_STORE_STUCK and one log line, if :meth:`shutdown`
        left store work blocked in I/O; else return.

        Without this, exit would wait for those threads without end: ``asyncio.run`` waits for
        its default executor's threads (the loads, saves and lookups), and the interpreter
        joins every ``concurrent.futures`` worker (the store's I/O threads) on its way out. A
        thread blocked on a disk that hung can wait for good, and the orchestrator's SIGKILL
        would be the only end.

        Ending here is sound: no store work still running was answered, so nobody counts on it.
        A save's thread writes from our own buffer to a temporary name, renamed into place only
        once written (a later start deletes the leftover, tiers.STALE_TMP_S); a load writes the
        engine's blocks, but never answered ``done``, so the engine recomputes them. The
        engine's memory is the engine's: its segments outlive us, only our mapping of them
        ends with the process (the NIXL agent is closed already). The kernel ends every thread
        at exit that it lets a kill end (NFS and FUSE waits for an unsent request are
        killable); one it holds uninterruptibly holds even SIGKILL up, nothing here can help.
        """
        if not self.stuck:
            return
        log.critical("exiting at once, exit status %d: %s still blocked in I/O after shutdown "
                     "(a hung disk?); not waiting for them", EXIT_STORE_STUCK,
                     self.stuck)  # fmt: skip
        logging.shutdown()  # flushes the handlers: the line above is out before we are gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STORE_STUCK)

    def close(self) -> None:
        """Stop the store's I/O threads (calls in progress finish first)."""
        if self.store is not None:
            self.store.close()

    def _stop_event(self) -> threading.Event:
        """A load's or save's stop event: set already once shutdown began (nothing copied)."""
        stop = threading.Event()
        if self._shutdown_by < math.inf:
            stop.set()
        return stop

    def _track(
        self, registry: dict[asyncio.Future[Any], V], value: V, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """``fn(*args)`` on a worker thread, in ``registry`` (with ``value``: the event
        :meth:`stop` sets, for work on the engine's memory) until it ends; await it shielded,
        so it is never marked done while the thread still runs."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        registry[work] = value
        work.add_done_callback(lambda done: registry.pop(done, None))
        return work

    def _require(self) -> Store:
        if self.store is None:
            raise StoreError("store_dir", "this sidecar has no store (start it with --store-dir)")
        return self.store

    def _sync_tiers(self) -> None:
        """Resident bytes, evictions and corrupt entries of both tiers into the metrics."""
        assert self.store is not None
        tiers: dict[str, TierStats] = {
            "dram": self.store.dram.stats,
            "file": self.store.files.stats,
        }
        for tier, stats in tiers.items():
            seen = self._reported[tier]
            self.metrics.store_resident_bytes.labels(tier).set(stats.bytes)
            self.metrics.store_evictions.labels(tier).inc(stats.evictions - seen.evictions)
            self.metrics.store_corrupt.labels(tier).inc(stats.corrupt - seen.corrupt)
            seen.evictions, seen.corrupt = stats.evictions, stats.corrupt
