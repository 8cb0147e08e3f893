"""The released-holds feed: cursor-addressed, bounded in records and in bytes, read in pages.

A record's size grows with its block ids (about 1 KB for 16 ids, 300 KB for 8,192), so a
bound on records alone lets the feed grow to gigabytes. The feed keeps at most ``max_records``
records and ``max_bytes`` of estimated record size, dropping the oldest first (an engine that
falls that far behind is told in the log). Pages are bounded the same way.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque

from kvxferd.errors import ConfigError, HoldRequestError
from kvxferd.wire import ReleasedHold, ReleasedHolds

logger = logging.getLogger(__name__)

RECORD_OVERHEAD = 512
"""Estimated bytes of a record without its block ids (ids, reason, containers)."""
BYTES_PER_ID = 40
"""Estimated bytes per block id held in memory (list slot and int object) and on the wire."""
PAGE_RECORDS = 1024
"""Records in one page when the caller names no limit."""
PAGE_BYTES = 1 << 20
"""Estimated bytes of one page (a page always holds at least one record)."""


def record_bytes(record: ReleasedHold) -> int:
    """Estimated memory (and JSON) bytes of one record."""
    return RECORD_OVERHEAD + BYTES_PER_ID * sum(len(g) for g in record.block_ids)


class ReleasedLog:
    """Released holds in release order; cursors count releases from 1."""

    def __init__(self, max_records: int = 65536, max_bytes: int = 64 << 20) -> None:
        for name, value in (("released_log_size", max_records), ("max_bytes", max_bytes)):
            if not (isinstance(value, int) and value > 0):
                raise ConfigError(f"{name}: must be an integer > 0, got {value!r}")
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._log: deque[tuple[int, ReleasedHold, int]] = deque()  # (cursor, record, bytes)
        self._by_hold: dict[str, ReleasedHold] = {}
        self._cursor = 0
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._log)

    @property
    def cursor(self) -> int:
        """Cursor of the newest record (0 before the first release)."""
        return self._cursor

    @property
    def bytes(self) -> int:
        """Estimated bytes of the records kept."""
        return self._bytes

    def get(self, hold_id: str) -> ReleasedHold | None:
        """The record of a hold released recently enough to still be kept."""
        return self._by_hold.get(hold_id)

    def append(self, record: ReleasedHold) -> int:
        """Add a record; drop the oldest ones beyond either bound. Returns its cursor."""
        size = record_bytes(record)
        self._cursor += 1
        self._log.append((self._cursor, record, size))
        self._by_hold[record.hold_id] = record
        self._bytes += size
        while len(self._log) > 1 and (
            len(self._log) > self.max_records or self._bytes > self.max_bytes
        ):
            _, old, old_size = self._log.popleft()
            self._bytes -= old_size
            if self._by_hold.get(old.hold_id) is old:
                del self._by_hold[old.hold_id]
        return self._cursor

    def since(
        self, cursor: int, limit: int | None = None, page_bytes: int = PAGE_BYTES
    ) -> ReleasedHolds:
        """Records after ``cursor`` (oldest first): at most ``limit`` records and about
        ``page_bytes`` (at least one record); ``more`` says whether newer ones wait.

        A cursor older than the oldest record kept means the feed overran (logged; those
        blocks were never reported). A cursor beyond the newest one (an engine talking to a
        restarted sidecar) restarts from the oldest record kept.
        """
        if cursor < 0:
            raise HoldRequestError("cursor", f"must be >= 0, got {cursor}")
        if limit is None:
            limit = PAGE_RECORDS
        if limit < 1:
            raise HoldRequestError("limit", f"must be >= 1, got {limit}")
        log = self._log
        if cursor > self._cursor:
            cursor = 0
        oldest = log[0][0] if log else self._cursor + 1
        if cursor < oldest - 1:
            logger.warning(
                "released feed overran: %d releases before cursor %d were dropped",
                oldest - 1 - cursor,
                oldest,
            )
        start = max(cursor, oldest - 1) - (oldest - 1)
        holds: list[ReleasedHold] = []
        last, size = max(cursor, oldest - 1), 0
        for at, record, nbytes in itertools.islice(log, start, None):
            if len(holds) >= limit or (holds and size + nbytes > page_bytes):
                break
            holds.append(record)
            last, size = at, size + nbytes
        return ReleasedHolds(holds=holds, cursor=last, more=last < self._cursor)
