"""The store: save a request's blocks as canonical chunks, look prefixes up, load them back.

Per group coverage: an attention group stores every chunk's KV; a Mamba/GDN group stores its
running state at the end of each saved request, under the key of the chunk that ends there
(the engine's state block holds the state after the last token). A lookup finds, per group, the
attention chunks present from the start and the chunks with a state; the match is the longest
prefix every group can serve (the minimum rule; a state must sit exactly at its end). Groups that
disagree are logged, never an error.

Every entry read from a file is checked (header digest, section CRCs, sizes) before any of its
bytes reach engine memory (DRAM entries are buffers this process gathered or already checked);
a file larger than any entry of its group can be is not even read (foreign or grown: it must not
size our memory); a corrupt entry is deleted, counted, and the load fails with
``store_corrupt`` (chunks loaded before it are not valid either: the engine treats a failed load
as no load). Writes go to the DRAM pool and through to files; reads prefer DRAM and promote.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from kvxferd.errors import BlockIdError, PullError, StoreError
from kvxferd.store import format as fmt
from kvxferd.store.canonical import (
    PartSpec,
    gather_attention,
    gather_state,
    group_fingerprint,
    part_bytes,
    part_specs,
    scatter_attention,
    scatter_state,
    token_map,
)
from kvxferd.store.coverage import Plan, plan_sources, unit_runs
from kvxferd.store.keys import check_keys, chunk_spans, window_first_chunk
from kvxferd.store.pool import BufferPool
from kvxferd.store.tiers import FILE_ENTRIES, Cached, DramTier, EntryId, FileTier
from kvxferd.wire import STORE_KEY_HEX, Manifest

log = logging.getLogger(__name__)

_IO_THREADS = 2
"""Threads that write entries (save) and read and check them (load) beside the gather/scatter:
file I/O and CRC32 release the GIL, so they overlap with the numpy copies."""
_AHEAD = 4
"""Entries in flight per call (bounds the memory a call holds beyond the engine's blocks)."""
STAGING_BYTES = 256 << 20
"""Free buffers the pool keeps for reuse (staging file reads and writes, evicted entries): a
store's memory is at most its DRAM capacity + this + the entries its calls have in flight."""


@dataclass
class SaveOutcome:
    """What a save did."""

    chunks_saved: int = 0
    chunks_present: int = 0
    chunks_skipped: int = 0
    """Entries not saved for want of their blocks (-1, a window's blocks gone, no state)."""
    kv_bytes: int = 0
    state_bytes: int = 0
    dram_bytes: int = 0
    file_bytes: int = 0
    duration_s: float = 0.0
    cut: str = ""
    """Why the save stopped copying early ("deadline", "stopped"); the entries it stored are
    kept."""


@dataclass
class LookupOutcome:
    """Matched tokens per group and the prefix all groups can serve."""

    per_group: list[int]
    matched: int
    disagree: bool = False


@dataclass
class LoadOutcome:
    """What a load moved, by kind and by tier."""

    tokens: int = 0
    kv_bytes: int = 0
    state_bytes: int = 0
    dram_bytes: int = 0
    file_bytes: int = 0
    duration_s: float = 0.0
    chunks: int = 0


class Store:
    """DRAM pool + file directory of canonical chunks; thread-safe, one per sidecar."""

    def __init__(
        self, root: str, chunk_tokens: int, dram_bytes: int, file_bytes: int, fsync: bool = False,
        pool: BufferPool | None = None, file_entries: int = FILE_ENTRIES,
    ) -> None:  # fmt: skip
        if chunk_tokens < 1:
            raise StoreError("store_chunk_tokens", f"{chunk_tokens} < 1")
        for name, capacity in (("store_dram_bytes", dram_bytes), ("store_file_bytes", file_bytes),
                               ("store_file_entries", file_entries)):  # fmt: skip
            if capacity < 0:
                raise StoreError(name, f"{capacity}: capacities must be >= 0")
        self.chunk_tokens = chunk_tokens
        self.dram = DramTier(dram_bytes)
        self.pool = pool or BufferPool(STAGING_BYTES)
        """Entry buffers (pass one to share a warm pool between stores, as the benchmark does)."""
        self.files = FileTier(root, file_bytes, fsync=fsync, max_entries=file_entries)
        self.disagreements = 0
        self._io = ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="kvxferd-store")

    def close(self) -> None:
        """Stop the I/O threads (after the calls in progress). Idempotent."""
        self._io.shutdown(wait=True)

    # -- save -----------------------------------------------------------------------------------

    def save(
        self,
        manifest: Manifest,
        regions: Sequence[np.ndarray],
        block_ids: Sequence[Sequence[int]],
        keys: Sequence[str],
        num_tokens: int,
        guard: Callable[[], None] | None = None,
        kept: Callable[[], None] | None = None,
        stop_at: float | None = None,
        stop: threading.Event | None = None,
    ) -> SaveOutcome:
        """Store every chunk of every group the request's blocks hold (present ones skipped).
        ``guard`` runs before each entry is copied out of ``regions`` and raises to stop the
        save (the sidecar's: a region's segment was truncated under it); ``kept`` runs after
        each copy and raises to drop that entry and stop (the blocks may have changed under it:
        the hold that pinned them was let go). Past ``stop_at`` (``time.monotonic()``) or once
        ``stop`` is set (both checked just before each copy) nothing more is copied: the caller
        may have freed the blocks, or the engine's memory is being let go. An entry whose copy
        ended past ``stop_at`` is not kept either (its blocks may have changed under it)."""
        t0 = time.perf_counter()
        ids = self._check(manifest, block_ids, keys, num_tokens)
        out = SaveOutcome()
        spans = chunk_spans(num_tokens, self.chunk_tokens)
        writes: deque[Future[int]] = deque()
        try:
            for g, group in enumerate(manifest.groups):
                fp = group_fingerprint(manifest, g, self.chunk_tokens)
                specs = part_specs(manifest, g)
                if group.kind == "mamba":
                    block = int(ids[g][-1]) if ids[g].size else -1
                    if not spans:
                        continue
                    if block < 0:
                        out.chunks_skipped += 1
                        continue
                    chunks = [len(spans) - 1]  # the state after the last token
                else:
                    chunks = list(range(len(spans)))
                for i, c in enumerate(chunks):
                    eid = EntryId(keys[c], fp, manifest.tp_size, manifest.tp_rank)
                    if self.dram.has(eid) or self.files.has(eid):
                        out.chunks_present += 1
                        continue
                    s, e = spans[c]
                    tm = None
                    if group.kind != "mamba":
                        try:
                            tm = token_map(group, ids[g], s, e, f"block_ids[{g}]")
                        except BlockIdError:
                            if group.kind == "sliding_window":
                                out.chunks_skipped += 1
                                continue  # blocks that left the window: save the ones still held
                            out.chunks_skipped += len(chunks) - i
                            break  # a missing block ends what this group can save
                    if guard is not None:
                        guard()
                    if stop_at is not None and time.monotonic() > stop_at:
                        out.cut = "deadline"
                    elif stop is not None and stop.is_set():
                        out.cut = "stopped"
                    if out.cut:
                        break
                    cached = self._gather(
                        manifest, regions, g, specs, eid, c, e - s, tm, ids[g], out
                    )
                    if kept is not None:
                        try:
                            kept()
                        except BaseException:
                            cached.buffer.release()
                            raise
                    if stop_at is not None and time.monotonic() > stop_at:
                        cached.buffer.release()  # the blocks may have been freed meanwhile
                        out.cut = "deadline"
                        break
                    if self.dram.put(eid, cached):
                        out.dram_bytes += cached.size
                    if len(writes) >= _AHEAD:  # bounded: at most _AHEAD entries wait for the disk
                        out.file_bytes += writes.popleft().result()
                    writes.append(self._io.submit(self._write, eid, cached))  # owns our reference
                    out.chunks_saved += 1
                if out.cut:
                    break
        finally:
            # A save that fails still waits for the entries it started writing (at most
            # _AHEAD): nothing of it runs on after it returns, e.g. under a shutdown.
            wait(writes)
        while writes:
            out.file_bytes += writes.popleft().result()
        out.duration_s = time.perf_counter() - t0
        return out

    def _gather(self, manifest, regions, g, specs, eid, c, tokens, tm, ids, out) -> Cached:  # noqa: ANN001, PLR0913
        """One entry's sections gathered into one pooled buffer, checksummed."""
        group = manifest.groups[g]
        sizes = [part_bytes(p, group, tokens) for p in specs]
        buf = self.pool.take(sum(sizes))
        datas, at = [], 0
        try:
            for p, n in zip(specs, sizes, strict=True):
                dst = buf.array[at : at + n]
                if tm is None:
                    datas.append(gather_state(regions[p.region], p, manifest.num_blocks,
                                              int(ids[-1]), dst))  # fmt: skip
                else:
                    datas.append(gather_attention(regions[p.region], p, group,
                                                  manifest.num_blocks, tm, dst))  # fmt: skip
                at += n
        except BaseException:
            buf.release()
            raise
        if tm is None:
            out.state_bytes += at
        else:
            out.kv_bytes += at
        header = fmt.Header(
            key=eid.key, group_fp=eid.group_fp, kind=group.kind, chunk=c, tokens=tokens,
            writer_tp_size=manifest.tp_size, writer_tp_rank=manifest.tp_rank,
            writer_block_size=group.block_size, writer_kernel_block_size=group.kernel_block_size,
            sections=[fmt.section(p.layer, p.name, p.owned.start, d, crc=False)
                      for p, d in zip(specs, datas, strict=True)],
        )  # fmt: skip
        sections = [memoryview(d).cast("B") for d in datas]
        return Cached(header, sections, len(fmt.encode_head(header)) + at, buf)

    def _write(self, eid: EntryId, cached: Cached) -> int:
        """Checksum and write one entry's file (an I/O thread, beside the next gather); releases
        the saver's buffer reference. The bytes written, 0 if the file tier refused them."""
        try:
            header = fmt.with_crcs(cached.header, cached.sections)
            head = fmt.encode_head(header)
            payload = memoryview(cached.buffer.array)[: fmt.payload_bytes(header)]
            return len(head) + len(payload) if self.files.write(eid, [head, payload]) else 0
        finally:
            cached.buffer.release()

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, manifest: Manifest, keys: Sequence[str], num_tokens: int) -> LookupOutcome:
        """Tokens each group can serve from the start of the prompt, and their minimum."""
        check_keys(keys, num_tokens, self.chunk_tokens)
        spans = chunk_spans(num_tokens, self.chunk_tokens)
        ends = [0] + [e for _s, e in spans]
        attention: list[int] = []  # chunks covered from the start
        states: list[tuple[str, list[PartSpec]]] = []
        windows: list[Callable[[int], bool]] = []  # can a window group serve the first n chunks
        per_group = []
        for g, group in enumerate(manifest.groups):
            fp = group_fingerprint(manifest, g, self.chunk_tokens)
            specs = part_specs(manifest, g)
            if group.kind == "sliding_window":
                present = [self._plan(k, fp, specs) is not None for k in keys]
                window = group.sliding_window or 0

                def serves(n: int, present: list[bool] = present, window: int = window) -> bool:
                    return all(present[window_first_chunk(spans, n, window) : n])

                windows.append(serves)
                per_group.append(ends[next(n for n in range(len(keys), -1, -1) if serves(n))])
            elif group.kind == "mamba":
                states.append((fp, specs))
                latest = next(
                    (c for c in reversed(range(len(keys))) if self._plan(keys[c], fp, specs)), -1
                )
                per_group.append(ends[latest + 1])
            else:
                n = 0
                while n < len(keys) and self._plan(keys[n], fp, specs):
                    n += 1
                attention.append(n)
                per_group.append(ends[n])
        limit = min(attention) if attention else len(keys)
        # The longest prefix within the limit where every Mamba group has its state at the end
        # and every sliding-window group the chunks of its window.
        m = next(
            (n for n in range(limit, 0, -1)
             if all(self._plan(keys[n - 1], fp, specs) for fp, specs in states)
             and all(serves(n) for serves in windows)),
            0,
        )  # fmt: skip
        matched = ends[m]
        disagree = any(t != matched for t in per_group)
        if disagree:
            self.disagreements += 1
            log.warning("store groups disagree on the prefix: %s tokens per group, using %d",
                        per_group, matched)  # fmt: skip
        return LookupOutcome(per_group, matched, disagree)

    # -- load -----------------------------------------------------------------------------------

    def load(
        self,
        manifest: Manifest,
        regions: Sequence[np.ndarray],
        block_ids: Sequence[Sequence[int]],
        keys: Sequence[str],
        num_tokens: int,
        stop_at: float | None = None,
        stop: threading.Event | None = None,
        guard: Callable[[], None] | None = None,
    ) -> LoadOutcome:
        """Write the first ``num_tokens`` tokens (all groups) into the blocks; PullError
        ``store_miss`` or ``store_corrupt`` when an entry is absent or fails its checks,
        ``deadline`` when ``time.monotonic()`` passes ``stop_at`` and ``cancelled`` once ``stop``
        is set (both checked before each chunk and after each entry's read: nothing is written
        once either happened; an entry being copied finishes). ``guard`` runs before each entry
        is written into ``regions`` and raises to stop the load, as :meth:`save`'s."""
        t0 = time.perf_counter()
        ids = self._check(manifest, block_ids, keys, num_tokens)
        spans = chunk_spans(num_tokens, self.chunk_tokens)
        out = LoadOutcome(tokens=num_tokens)
        if not spans:
            return out
        work, most = [], []  # most: per group, the bytes an entry's file may have
        for g, group in enumerate(manifest.groups):
            fp = group_fingerprint(manifest, g, self.chunk_tokens)
            specs = part_specs(manifest, g)
            most.append(max_entry_bytes(fp, group.kind, specs, self.chunk_tokens))
            if group.kind == "mamba":
                if not ids[g].size or ids[g][-1] < 0:
                    raise BlockIdError(f"block_ids[{g}]", "no state block to load into")
                chunks = [len(spans) - 1]
            else:
                first = 0
                if group.kind == "sliding_window":  # only the window before the next token
                    first = window_first_chunk(spans, len(spans), group.sliding_window or 0)
                token_map(group, ids[g], spans[first][0], num_tokens, f"block_ids[{g}]")
                chunks = list(range(first, len(spans)))
            for c in chunks:
                plan = self._plan(keys[c], fp, specs)
                if plan is None:
                    raise PullError("store_miss", f"group {g} chunk {c} is not in the store")
                work.append((g, c, specs, plan))
        # Entries are read and checked by the I/O threads, up to _AHEAD ahead of the scatter.
        order = iter([(eid, most[g]) for g, _c, _s, plan in work for eid in plan.entries])
        ahead: deque[Future[tuple[Cached, str]]] = deque()

        def fetch(eid: EntryId) -> Cached:
            while len(ahead) < _AHEAD and (nxt := next(order, None)) is not None:
                ahead.append(self._io.submit(self._fetch, *nxt))
            cached, tier = ahead.popleft().result()
            if stop_at is not None and time.monotonic() > stop_at:  # the read outlasted it
                cached.buffer.release()
                raise PullError("deadline", f"the load passed its deadline reading {eid.filename}")
            if stop is not None and stop.is_set():
                cached.buffer.release()
                raise PullError("cancelled", f"the load was stopped reading {eid.filename}")
            if guard is not None:
                try:
                    guard()
                except BaseException:
                    cached.buffer.release()
                    raise
            if tier == "dram":
                out.dram_bytes += cached.size
            else:
                out.file_bytes += cached.size
            return cached

        try:
            for g, c, specs, plan in work:
                if stop_at is not None and time.monotonic() > stop_at:
                    raise PullError("deadline", f"the load passed its deadline at chunk {c}")
                if stop is not None and stop.is_set():
                    raise PullError("cancelled", f"the load was stopped at chunk {c}")
                self._load_chunk(manifest, regions, ids[g], g, c, spans[c], specs, plan, out,
                                 fetch)  # fmt: skip
        finally:
            for f in ahead:
                f.cancel()
            wait(ahead)
            for f in ahead:  # fetched but not scattered (the load failed): let their buffers go
                if not f.cancelled() and f.exception() is None:
                    f.result()[0].buffer.release()
        out.duration_s = time.perf_counter() - t0
        return out

    def _load_chunk(self, manifest, regions, ids, g, c, span, specs, plan, out, fetch) -> None:  # noqa: ANN001, PLR0913
        group = manifest.groups[g]
        s, e = span
        tm = None if group.kind == "mamba" else token_map(group, ids, s, e, f"block_ids[{g}]")
        by_spec = {(p.layer, p.name): p for p in specs}
        wanted = plan.units_from(by_spec.values())
        for eid in plan.entries:
            cached = fetch(eid)
            try:
                self._scatter(manifest, regions, ids, g, c, span, plan, eid, cached, tm, by_spec,
                              wanted[eid], out)  # fmt: skip
            finally:
                cached.buffer.release()
        out.chunks += 1

    def _scatter(self, manifest, regions, ids, g, c, span, plan, eid, cached, tm, by_spec, want,  # noqa: ANN001, ANN202, PLR0913
                 out):  # fmt: skip
        """Write one entry's sections (the units the plan takes from it) into the blocks."""
        group = manifest.groups[g]
        s, e = span
        header = cached.header
        if header.tokens != e - s or header.chunk != c or header.kind != group.kind:
            self._corrupt(eid, "header does not match the request's chunk")
        runs = self._runs(plan, eid, cached, by_spec, None if tm is None else e - s, want)
        for sec, data, spec, units in runs:
            for lo, hi in units:
                local = slice(lo - spec.owned.start, hi - spec.owned.start)
                rows = data[(lo - sec.unit_start) * sec.unit_bytes :
                            (hi - sec.unit_start) * sec.unit_bytes]  # fmt: skip
                arr = np.frombuffer(rows, dtype=np.uint8)
                if tm is None:
                    arr = arr.reshape(hi - lo, sec.unit_bytes)
                    scatter_state(regions[spec.region], spec, manifest.num_blocks, int(ids[-1]),
                                  local, arr)  # fmt: skip
                    out.state_bytes += arr.nbytes
                else:
                    arr = arr.reshape(hi - lo, e - s, spec.row_bytes)
                    scatter_attention(regions[spec.region], spec, group, manifest.num_blocks, tm,
                                      local, arr)  # fmt: skip
                    out.kv_bytes += arr.nbytes

    def _runs(self, plan, eid, cached, by_spec, tokens, want):  # noqa: ANN001, ANN202
        """(section, bytes, spec, unit runs) of what the entry supplies under the plan; corrupt
        unless that is every unit (``want``) the plan takes from it, once, in units of the right
        size (fail closed: a load never leaves a unit it planned unwritten). A part has one
        section: a repeat would count its units twice and let another part's go unwritten."""
        runs, got, seen = [], 0, set()
        for sec, data in zip(cached.header.sections, cached.sections, strict=True):
            spec = by_spec.get((sec.layer, sec.part))
            if spec is None:
                continue
            if (sec.layer, sec.part) in seen:
                self._corrupt(eid, f"section layer {sec.layer} {sec.part} repeated")
            seen.add((sec.layer, sec.part))
            size = spec.row_bytes * (1 if tokens is None else tokens)
            units = unit_runs(plan, eid, spec, sec)
            if units and sec.unit_bytes != size:
                self._corrupt(eid, f"section layer {sec.layer} {sec.part}: units of "
                              f"{sec.unit_bytes} bytes, not {size}")  # fmt: skip
            got += sum(hi - lo for lo, hi in units)
            runs.append((sec, data, spec, units))
        if got != want:
            self._corrupt(eid, f"holds {got} of the {want} units its name promises")
        return runs

    def _fetch(self, eid: EntryId, most: int) -> tuple[Cached, str]:
        """An entry (holding a buffer reference for the caller) and its tier: from DRAM, else
        from its file of at most ``most`` bytes (every checksum checked, then kept in DRAM).
        Runs in an I/O thread."""
        cached = self.dram.get(eid)
        if cached is not None:
            return cached, "dram"
        try:
            read = self.files.read(eid, self.pool.take, most)
        except fmt.CorruptEntry as exc:
            self.files.drop(eid, corrupt=True)
            raise PullError("store_corrupt", f"{eid.filename}: {exc}") from None
        if read is None:
            raise PullError("store_miss", f"{eid.filename} went away (evicted)")
        buf, size = read
        data = memoryview(buf.array)[:size]
        try:
            header, start = fmt.read_header(data, size)
            datas = fmt.sections(header, data[start:])
            if header.key != eid.key or header.group_fp != eid.group_fp:
                raise fmt.CorruptEntry("key or group fingerprint differs from the file name")
        except fmt.CorruptEntry as exc:
            buf.release()
            self.files.drop(eid, corrupt=True)
            raise PullError("store_corrupt", f"{eid.filename}: {exc}") from None
        cached = Cached(header, datas, size, buf)
        self.dram.put(eid, cached)
        return cached, "file"

    def _corrupt(self, eid: EntryId, why: str) -> None:
        self.dram.drop(eid, corrupt=True)
        self.files.drop(eid, corrupt=True)
        raise PullError("store_corrupt", f"{eid.filename}: {why}")

    # -- helpers --------------------------------------------------------------------------------

    def _plan(self, key: str, fp: str, specs: list[PartSpec]) -> Plan | None:
        """Entries (DRAM first) that together hold every unit this rank needs, or None."""
        return plan_sources(self.dram.writers(key, fp) + self.files.writers(key, fp), specs)

    def _check(
        self, manifest: Manifest, block_ids: Sequence[Sequence[int]], keys: Sequence[str], n: int
    ) -> list[np.ndarray]:
        check_keys(keys, n, self.chunk_tokens)
        if len(block_ids) != len(manifest.groups):
            raise BlockIdError("block_ids", f"{len(block_ids)} groups, the manifest has "
                               f"{len(manifest.groups)}")  # fmt: skip
        out = []
        for g, group_ids in enumerate(block_ids):
            arr = np.asarray(group_ids, dtype=np.int64).reshape(-1)
            bad = np.flatnonzero((arr < -1) | (arr >= manifest.num_blocks))
            if bad.size:
                i = int(bad[0])
                raise BlockIdError(f"block_ids[{g}][{i}]", f"{arr[i]} outside [-1, "
                                   f"{manifest.num_blocks})")  # fmt: skip
            group = manifest.groups[g]
            need = -(-n // group.block_size)
            if group.kind != "mamba" and 0 < arr.size < need:
                # A shorter list covers the request's last blocks (a sliding window): as in
                # pulls, its first entry is block ``need - len``, the ones before are gone.
                arr = np.concatenate([np.full(need - arr.size, -1, dtype=np.int64), arr])
            out.append(arr)
        return out


def max_entry_bytes(fp: str, kind: str, specs: list[PartSpec], tokens: int) -> int:
    """The most bytes an entry of the group with chunks of ``tokens`` can have, whatever TP rank
    wrote it: a header with every number in msgpack's widest form and every global unit of every
    part (a writer holds at most those; one whose parts differ from ``specs`` fails the load's
    checks anyway)."""
    widest = (1 << 64) - 1
    header = fmt.Header(
        key="0" * STORE_KEY_HEX, group_fp=fp, kind=kind, chunk=widest, tokens=widest,
        writer_tp_size=widest, writer_tp_rank=widest, writer_block_size=widest,
        writer_kernel_block_size=widest,
        sections=[fmt.Section(widest, p.name, widest, widest, widest, widest) for p in specs],
    )  # fmt: skip
    payload = sum(p.units_total * p.row_bytes * (1 if p.attention is None else tokens)
                  for p in specs)  # fmt: skip
    return len(fmt.encode_head(header)) + payload
