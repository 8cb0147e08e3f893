"""The two tiers: a bounded host-DRAM pool and a directory of files, each evicting LRU by bytes
(the files by their count too).

Both hold encoded entries (:mod:`kvxferd.store.format`) under an :class:`EntryId`. Files are
written to a temporary name and renamed into place, so a reader never sees a half-written entry
under its final name; leftover temporaries (a crash mid-write) are removed at start once they are
older than any write takes (``STALE_TMP_S``). fsync
policy: none by default. The store is a cache: after a power loss a renamed file may be empty or
torn, and its checksums then fail, so it is deleted and counted instead of loaded. ``fsync=True``
syncs each file before its rename, for directories shared with something that needs durability.

The file tier's bounds (bytes, files) are per process, over the files it knows: its own writes,
what it found at start and what lookups and reads discover; sidecars sharing a directory should
split them. A sibling's file counts once known (at start: every file) and is evicted like ours,
so a shared directory holds less than the sum of the bounds, never more (but for the files of a
sidecar gone for good, until another one starts or meets them); a file a sibling removed stays
counted until a read misses it or our eviction reaches it. The files carry no owner: replicas
of one engine setup write the very same names, and each sidecar adopting what it finds is what
keeps the files of a setup no longer running (another model, TP size) bounded.
Only plain files are entries: a link, FIFO or directory under an entry's name is not counted
or offered (a read that meets one drops it as corrupt; a link's target is never touched). Only
real directories are the ``<key[:2]>`` subdirectories: one that is a link (to a place outside the
store) is never read, written or deleted in, its prefix's saves fail as a write error. The
directories the tier makes are 0700 and its files 0600: entry names are prompt-prefix hashes.
Beside the subdirectories the root holds ``.clock``, whose mtime the tier sets to tell the
filesystem's time (lookups reuse a subdirectory's listing until its mtime moves past it).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvxferd.store.format import CorruptEntry, Header
from kvxferd.store.pool import Buffer

log = logging.getLogger(__name__)

SUFFIX = ".kvx"
_TMP = ".tmp"
_NAME_RE = re.compile(
    r"([0-9a-f]{32})-([0-9a-f]{16})-t([1-9][0-9]*)r(0|[1-9][0-9]*)" + re.escape(SUFFIX)
)
"""A store file name (what :attr:`EntryId.filename` writes, nothing else)."""
_TMP_RE = re.compile(_NAME_RE.pattern + r"\.[0-9]+\.[0-9a-f]+" + re.escape(_TMP))
"""A temporary written by :meth:`FileTier.write`."""
_SUBDIR_RE = re.compile(r"[0-9a-f]{2}")
_CLOCK = ".clock"
"""A file in the root the tier sets to "now" before it lists a subdirectory: the filesystem's
own clock, with the granularity of the directories' mtimes (see :class:`_Listing`)."""
CLOCK_REUSE_S = 0.01
"""How long one reading of the clock file serves the listings that follow (an older reading is
still a bound: it only leaves more of them untrusted), so lookups set it at most 100 times/s."""
FILE_ENTRIES = 1 << 18
"""Default bound on the files a file tier keeps (``store_file_entries``): a flood of tiny entries
within the byte budget would otherwise run the disk out of inodes and the index (``_sizes`` and
the listings, ~440 bytes a file) out of memory; 262,144 files are ~4 MiB an entry at the default
64 GiB, ~1k files a subdirectory."""
STALE_TMP_S = 600.0
"""Age past which a temporary is a crash's leftover (a sidecar sharing the directory may be
writing a younger one right now)."""


class EntryId(NamedTuple):
    """One chunk of one group as saved by one rank of one TP size."""

    key: str
    group_fp: str
    tp_size: int
    tp_rank: int

    @property
    def filename(self) -> str:
        """``<key>-<group fp>-t<tp>r<rank>.kvx``."""
        return f"{self.key}-{self.group_fp}-t{self.tp_size}r{self.tp_rank}{SUFFIX}"


def parse_filename(name: str) -> EntryId | None:
    """The EntryId of a store file name, None for anything else."""
    m = _NAME_RE.fullmatch(name)
    if m is None:
        return None
    return EntryId(m[1], m[2], int(m[3]), int(m[4]))


@dataclass
class TierStats:
    """Counters of one tier (monotonic except ``bytes`` and ``entries``)."""

    bytes: int = 0
    """Memory (DRAM: the entries' buffers, each its size class) or disk (file sizes) held."""
    entries: int = 0
    evictions: int = 0
    corrupt: int = 0
    partial_removed: int = 0
    write_errors: int = 0


@dataclass(frozen=True)
class Cached:
    """An entry held in DRAM: its parsed header and section bytes (checked when they came from
    a file, gathered by this process when saved: their CRCs are computed only for the file)
    inside a pooled buffer, and its encoded size."""

    header: Header
    sections: list[memoryview]
    size: int
    buffer: Buffer

    @property
    def held(self) -> int:
        """Bytes of memory the entry keeps: its buffer (a size class, up to a quarter over what
        it holds), or ``size`` where larger (a saved entry's buffer holds only its sections)."""
        return max(self.buffer.array.nbytes, self.size)


class DramTier:
    """Entries in host memory, least recently used evicted past ``capacity`` bytes of buffers
    held (:attr:`Cached.held`, not the entries' sizes: the bound is on memory). No copy and
    no checksum pass: an entry is kept in the buffer it was saved or read into. The tier holds
    one reference to each entry's buffer; :meth:`get` hands out another."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stats = TierStats()
        self._entries: OrderedDict[EntryId, Cached] = OrderedDict()
        self._by_key: dict[tuple[str, str], set[EntryId]] = {}
        self._lock = threading.Lock()

    def writers(self, key: str, group_fp: str) -> list[EntryId]:
        """Entries held for (key, group)."""
        with self._lock:
            return list(self._by_key.get((key, group_fp), ()))

    def has(self, eid: EntryId) -> bool:
        """Whether the entry is held (no LRU update)."""
        with self._lock:
            return eid in self._entries

    def get(self, eid: EntryId) -> Cached | None:
        """The entry with a reference the caller releases (marks it recently used), or None."""
        with self._lock:
            data = self._entries.get(eid)
            if data is not None:
                self._entries.move_to_end(eid)
                data.buffer.acquire()
            return data

    def put(self, eid: EntryId, data: Cached) -> bool:
        """Keep ``data`` (taking a reference), evicting LRU entries; False if its buffer alone
        exceeds the capacity or the entry is already held."""
        held = data.held
        if held > self.capacity:
            return False
        with self._lock:
            if eid in self._entries:
                self._entries.move_to_end(eid)
                return False
            while self.stats.bytes + held > self.capacity and self._entries:
                self._remove(next(iter(self._entries)))
                self.stats.evictions += 1
            self._entries[eid] = data
            data.buffer.acquire()
            self._by_key.setdefault((eid.key, eid.group_fp), set()).add(eid)
            self.stats.bytes += held
            self.stats.entries += 1
            return True

    def drop(self, eid: EntryId, corrupt: bool = False) -> None:
        """Forget an entry (counted as corrupt when it failed its checks)."""
        with self._lock:
            if eid in self._entries:
                self._remove(eid)
                self.stats.corrupt += int(corrupt)

    def clear(self) -> None:
        """Forget every entry (their buffers go back to the pool once no reader holds them)."""
        with self._lock:
            for eid in list(self._entries):
                self._remove(eid)

    def _remove(self, eid: EntryId) -> None:
        data = self._entries.pop(eid)
        data.buffer.release()
        ids = self._by_key[(eid.key, eid.group_fp)]
        ids.discard(eid)
        if not ids:
            del self._by_key[(eid.key, eid.group_fp)]
        self.stats.bytes -= data.held
        self.stats.entries -= 1


@dataclass
class _Listing:
    """The names in one subdirectory, listed when its (inode, mtime) was ``stamp``: reused while
    that is unchanged, if ``trusted``. A sibling's file created in the same timestamp tick as a
    listing leaves the mtime as it was, so a listing is trusted only if the mtime is older than
    the clock file's, set just before it (git's "racy" index rule)."""

    stamp: tuple[int, int]
    trusted: bool
    names: list[str]
    """As listed (never changed: lookups read it without the lock)."""
    index: list[str] | None = None
    """The names sorted, for bisection: made by a trusted listing's second lookup (one that is
    replaced before it is used again, the common case while siblings write, costs no sort)."""
    lookups: int = 0


class FileTier:
    """Entries as files under ``root/<key[:2]>/``, LRU (by use, then mtime) past ``capacity``
    bytes or ``max_entries`` files.

    Lookups list a subdirectory once and reuse that while its mtime shows no change, so their
    cost does not grow with the directory. The listings hold one name per file of the (at most
    256) subdirectories looked up: the store's entries and writes in progress, as many as
    ``_sizes`` holds items, at ~120 bytes each against ~320 for an item of ``_sizes``.
    """

    def __init__(
        self, root: str | os.PathLike[str], capacity: int, fsync: bool = False,
        max_entries: int = FILE_ENTRIES,
    ) -> None:  # fmt: skip
        self.root = Path(root)
        self.capacity = capacity
        self.max_entries = max_entries
        self.fsync = fsync
        self.stats = TierStats()
        self._sizes: OrderedDict[EntryId, int] = OrderedDict()
        self._listings: dict[str, _Listing] = {}
        self._dir = os.fspath(self.root)  # the lookups' paths as str: pathlib costs ~5 us each
        self._clock_read: tuple[float, tuple[int, int]] | None = None  # (monotonic, _clock())
        self._lock = threading.Lock()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._scan()

    def path(self, eid: EntryId) -> Path:
        """Where the entry's file lives."""
        return self.root / eid.key[:2] / eid.filename

    def writers(self, key: str, group_fp: str) -> list[EntryId]:
        """Entries on disk for (key, group), including ones other processes wrote. One stat of
        the subdirectory while it is unchanged; a new listing after any change. A name listed
        may be gone by the time it is read (a miss), never wrong: reads check every entry."""
        sub = key[:2]
        try:
            st = os.lstat(os.path.join(self._dir, sub))
        except OSError:  # no such directory (nothing saved under this prefix), or unreadable
            return []
        if not stat.S_ISDIR(st.st_mode):  # a link (elsewhere) or a file: no entries of ours
            return []
        with self._lock:
            listing = self._listings.get(sub)
        if listing is None or not listing.trusted or listing.stamp != (st.st_ino, st.st_mtime_ns):
            listing = self._list(sub)
            if listing is None:
                return []
        prefix = f"{key}-{group_fp}-"
        index = listing.index
        if index is not None:
            i = j = bisect.bisect_left(index, prefix)
            while j < len(index) and index[j].startswith(prefix):
                j += 1
            found = index[i:j]
        else:
            found = [n for n in listing.names if n.startswith(prefix)]
            listing.lookups += 1
            if listing.trusted and listing.lookups == 2:
                listing.index = sorted(listing.names)
        out = []
        for eid in map(parse_filename, found):
            if eid is None:
                continue
            if eid not in self._sizes:  # a sibling's (or no plain file: not an entry)
                try:
                    file_st = os.stat(self.path(eid), follow_symlinks=False)
                except OSError:  # gone since the listing
                    continue
                if not stat.S_ISREG(file_st.st_mode):
                    continue
                with self._lock:
                    self._add(eid, file_st.st_size)  # its bytes count from now on
            out.append(eid)
        return out

    def has(self, eid: EntryId) -> bool:
        """Whether the entry's file exists (a plain file in a real subdirectory, no link)."""
        try:
            if not stat.S_ISDIR(os.lstat(self.path(eid).parent).st_mode):
                return False
        except OSError:
            return False
        return _is_plain(self.path(eid))

    def write(self, eid: EntryId, buffers: Sequence[bytes | memoryview]) -> bool:
        """Write the entry (temp + rename) unless present; False if it was not written."""
        size = sum(len(b) for b in buffers)
        final, name = self.path(eid), eid.filename
        if size > self.capacity or self.max_entries < 1:
            return False
        tmp = f"{name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP}"
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            dfd = _open_dir(final.parent)
        except OSError as exc:  # not a directory, or a link to one elsewhere
            return self._write_failed(final, exc)
        try:
            if _is_plain(name, dfd):
                return False
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
            try:
                try:
                    _write_all(fd, buffers)
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                # over a link or FIFO there: the name, never its target
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        except OSError as exc:  # disk full, directory gone: the DRAM tier still has the entry
            return self._write_failed(final, exc)
        finally:
            os.close(dfd)
        with self._lock:
            self._add(eid, size)
            self._changed(eid)
            self._evict(keep=eid)
        return True

    def _write_failed(self, path: Path, exc: OSError) -> bool:
        log.warning("store file %s not written: %s", path, exc)
        with self._lock:
            self.stats.write_errors += 1
        return False

    def read(
        self, eid: EntryId, alloc: Callable[[int], Buffer], max_size: int
    ) -> tuple[Buffer, int] | None:
        """The file's bytes in a buffer from ``alloc`` and how many there are (the mtime is
        refreshed where it can be: LRU across restarts), None if the file is gone or
        unreadable. CorruptEntry, with nothing allocated, for a file over ``max_size`` (more
        than any entry of its group holds: a foreign or grown file must not size our memory)
        and for anything but a plain file under the entry's name (a link, a FIFO, a directory:
        the caller drops it)."""
        path = self.path(eid)
        buf = None
        try:
            # Never through a link, never blocking on a FIFO: only a plain file is an entry.
            dfd = _open_dir(path.parent)
            try:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                fd = os.open(eid.filename, flags, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptEntry(f"not a plain file (mode {st.st_mode:o})")
                size = st.st_size
                if size > max_size:
                    raise CorruptEntry(
                        f"{size} bytes, an entry of its group has at most {max_size}"
                    )
                buf = alloc(size)
                view, got = memoryview(buf.array)[:size], 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if not n:
                        break
                    got += n
                with contextlib.suppress(OSError):  # read-only, not ours: a hint, not needed
                    os.utime(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            if buf is not None:
                buf.release()
            with self._lock:
                self._forget(eid)
            return None
        except OSError as exc:  # unreadable: a miss (the load fails, the engine recomputes)
            if buf is not None:
                buf.release()
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise CorruptEntry("a symbolic link, not a plain file") from None
            log.warning("store file %s unreadable: %s", path, exc)
            return None
        with self._lock:
            if eid in self._sizes:
                self._sizes.move_to_end(eid)
            else:
                self._add(eid, size)
        return buf, got

    def drop(self, eid: EntryId, corrupt: bool = False) -> None:
        """Delete an entry's file (counted as corrupt when it failed its checks)."""
        _unlink(self.path(eid))
        with self._lock:
            self._forget(eid)
            self.stats.corrupt += int(corrupt)

    # -- internals --------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the entries on disk and remove leftover temporaries: only in the store's own
        ``<key[:2]>`` subdirectories (never through a link), only names the store writes, only
        ones older than STALE_TMP_S."""
        found, now = [], time.time()
        for sub in os.scandir(self.root):
            if not (_SUBDIR_RE.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for entry in os.scandir(sub.path):
                if _TMP_RE.fullmatch(entry.name):
                    with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
                        if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                            Path(entry.path).unlink(missing_ok=True)
                            self.stats.partial_removed += 1
                    continue
                eid = parse_filename(entry.name)
                if eid is not None and eid.key[:2] == sub.name:
                    with contextlib.suppress(FileNotFoundError):  # a sibling evicted it meanwhile
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode):
                            found.append((st.st_mtime_ns, eid, st.st_size))
        with self._lock:
            for _mtime, eid, size in sorted(found):
                self._add(eid, size)
            self._evict(keep=None)

    def _list(self, sub: str) -> _Listing | None:
        """List a subdirectory (None if it is gone or unreadable) and keep the listing."""
        clock = self._clock()
        path = os.path.join(self._dir, sub)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):  # replaced by a link since writers() looked
                raise NotADirectoryError(path)
            names = os.listdir(path)
        except OSError:
            with self._lock:
                self._listings.pop(sub, None)
            return None
        # Trusted if the last change is a tick before the clock file's: any later one has a
        # newer mtime (same filesystem only: another one's clock says nothing of it).
        trusted = clock is not None and clock[0] == st.st_dev and st.st_mtime_ns < clock[1]
        listing = _Listing((st.st_ino, st.st_mtime_ns), trusted, names)
        with self._lock:
            self._listings[sub] = listing
        return listing

    def _clock(self) -> tuple[int, int] | None:
        """The filesystem's time now, or up to CLOCK_REUSE_S before: (device, mtime) of the clock
        file once set to now (None where it cannot be: no listing is trusted then, every lookup
        lists)."""
        now, read = time.monotonic(), self._clock_read
        if read is not None and now - read[0] < CLOCK_REUSE_S:
            return read[1]
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(os.path.join(self._dir, _CLOCK), flags, 0o600)
        except OSError:
            return None
        try:
            os.utime(fd)
            st = os.fstat(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        self._clock_read = (now, (st.st_dev, st.st_mtime_ns))
        return self._clock_read[1]

    def _changed(self, eid: EntryId) -> None:
        """Our own write: the entry's subdirectory is listed again at its next lookup (its mtime
        says so too, where the filesystem's times are fine enough). Under _lock. (A removal
        needs nothing: a name listed but unknown to ``_sizes`` is checked before it is offered.)"""
        self._listings.pop(eid.key[:2], None)

    def _add(self, eid: EntryId, size: int) -> None:
        if eid in self._sizes:
            return
        self._sizes[eid] = size
        self.stats.bytes += size
        self.stats.entries += 1

    def _forget(self, eid: EntryId) -> None:
        size = self._sizes.pop(eid, None)
        if size is not None:
            self.stats.bytes -= size
            self.stats.entries -= 1

    def _evict(self, keep: EntryId | None) -> None:
        """Remove least recently used entries (never ``keep``) until both bounds hold. Under
        _lock."""
        while self.stats.bytes > self.capacity or self.stats.entries > self.max_entries:
            lru = iter(self._sizes)  # anew each time: no copy of the index per write
            eid = next(lru, None)
            if eid is not None and eid == keep:
                eid = next(lru, None)
            if eid is None:
                return
            _unlink(self.path(eid))
            self._forget(eid)
            self.stats.evictions += 1


def _is_plain(path: Path | str, dir_fd: int | None = None) -> bool:
    """Whether ``path`` is a plain file (not through a link)."""
    try:
        return stat.S_ISREG(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_dir(path: Path) -> int:
    """A descriptor of the subdirectory ``path`` itself: ELOOP (OSError) where it is a link, so
    the names under it are opened, renamed and removed only inside the store."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _unlink(path: Path) -> None:
    """Remove an entry's name (a link: the link, not its target; under a subdirectory that is
    a link: nothing); one that cannot be (a directory) is logged and left: lookups never
    offer it."""
    try:
        dfd = _open_dir(path.parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("store file %s not removed: %s", path, exc)
        return
    try:
        os.unlink(path.name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("store file %s not removed: %s", path, exc)
    finally:
        os.close(dfd)


def _write_all(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """os.writev until every byte is written (writev may stop short)."""
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        n = os.writev(fd, pending[:512])
        while n and pending:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0
